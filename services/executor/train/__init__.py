"""Pipeline x data-parallel training worker runtime: one process per (stage, replica).

Small composable pieces (torchtitan-style): `config` (what to run, plain JSON), `schedule` (1F1B/GPipe task
order), `data` (deterministic samples any split sees identically), `stage` (this stage's layers of the zoo
model), `dims` (named parallel axes and the rank layout, pure), `mesh` (every process group, made once, by
axis), `comms` (async p2p, gradient reductions), `migration` (live plan changes), `checkpoint` (per-layer files
reloadable under another partition), `trainer` (the training loop), `worker` (process entry point and its
JSON-line reports), `reference` (the single-process run the distributed losses must equal) and `launch`
(a whole plan as local processes). Launch: `python -m services.executor.train.worker
CONFIG.json`. Nothing here imports grpc.
"""
