"""Memory engines shared by the planner and the executors: PatrickStar's chunk layout and residency policy, a
worker's memory budget, Harmony's schedule. Pure (no grpc, no store, no torch), so the planner's simulator and
the executor's managers run the same code."""
