"""The read-only web dashboard: fleet, queue, jobs, plans and profiles in a browser.

It holds no data of its own and runs no SQL: every page is read over gRPC as the visitor's bearer token
(the store's typed interface, the planner's FleetService), so tenant isolation and roles apply as they do
to the CLI. `reads` turns replies into plain rows, `charts` and `gantt` build figures, `app` serves them.
"""
