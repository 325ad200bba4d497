"""What users write down, read and checked in one place: model specs, fleet files, the device catalog.

Every service (store, profiler, planner) and the CLI reads these files and figures, so they live
beside the contracts rather than in any one service: this package imports only ballast.v1,
ballast.config and services.runtime, and no service has to reach into another for them.
"""
