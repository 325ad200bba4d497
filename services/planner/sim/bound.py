"""A lower bound on one iteration's time that needs no simulation, for searches to skip what cannot win.

For a pipeline of P stages (one device each, no swaps) and Nm micro-batches, whatever the schedule:
- stage b's device cannot start before the first micro-batch's forward has crossed the stages and links before
  it; it then runs Nm forwards, backwards and (but on the last stage, which may skip them) recomputes; after its
  last backward its sync and optimizer step run, and that gradient must still cross the links and stages
  before it back;
- link s -> s+1 carries Nm activations one at a time (and link s+1 -> s Nm gradients): it cannot start before
  the first one is produced, and after the last one crosses, that micro-batch's gradient must still come back
  through the stages up to s.
The iteration lasts at least the largest of these. Tests check it against the simulator on every schedule.
"""

from __future__ import annotations

from services.planner.sim.core import B, F, R, prepare
from services.planner.sim.model import Pipeline, Schedule


def iteration_floor(pipe: Pipeline, schedule: Schedule) -> float:
    """Seconds no simulated iteration of `pipe` under `schedule` can beat (module docstring)."""
    prep = prepare(pipe, schedule)
    P, nm = prep.P, prep.Nm
    f, r, b = prep.dur[F], prep.dur[R], prep.dur[B]
    act, grad = prep.act_link, prep.grad_link
    if len(set(prep.fdev)) != P or any(prep.swap_in) or prep.fdev != prep.bdev:
        return 0.0  # stages share a device (Harmony) or wait on swaps: no claim
    # to_b[s]: the first forward reaches stage s; back[s]: a gradient leaving stage s's backward start reaches
    # the end of stage 0's backward (stage s's own backward included).
    to_b = [0.0] * P
    for s in range(1, P):
        to_b[s] = to_b[s - 1] + f[s - 1] + act[s - 1]
    back = [0.0] * P
    for s in range(P):
        back[s] = b[s] + (back[s - 1] + grad[s - 1] if s > 0 else 0.0)
    total_f = to_b[-1] + f[-1]
    best = 0.0
    for s in range(P):
        busy = f[s] + b[s] + (r[s] if s < P - 1 else 0.0)
        tail = max(prep.allreduce[s], back[s - 1] + grad[s - 1] if s > 0 else 0.0)
        best = max(best, to_b[s] + nm * busy + tail)
    for s in range(P - 1):
        # activations: the first leaves stage s after to_b[s] + f[s]; after the last arrives, stage s+1 runs
        # at least its backward, and the gradient crosses back over stages <= s
        best = max(best, to_b[s] + f[s] + nm * act[s] + b[s + 1] + grad[s] + back[s])
        # gradients: the first enters link s+1 -> s after the first forward reaches the end and the backwards
        # of stages > s have run (with their links); after the last crosses, stages <= s run their backwards
        first = total_f + sum(b[j] for j in range(s + 1, P)) + sum(grad[j] for j in range(s + 1, P - 1))
        best = max(best, first + nm * grad[s] + back[s])
    return best
