"""A command's max-length searches, one method after another (`sbp maxlen`).

Measured probes start at the estimator's predicted max T (simulated_search.py `estimate_seed`),
stored in `out` beside them (seeds.py), and run under an optional wall-clock budget (budget.py);
predicted probes (--simulate) run on fake tensors. Each search's probes and answer go to `out` as
they come, so a search stopped by the budget, a failed probe or Ctrl-C resumes from them. The
command gets an Outcome (outcome.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import MaxlenSpec
from ..records import ResultRow
from .budget import BudgetSpent
from .maxlen import ProbeFailed
from .outcome import Outcome, Steps, point_line, seq_bound


@dataclass(frozen=True)
class Probing:
    """How a command's probes run: measured (under `budget_s`, as given in `budget`) or predicted
    (`simulate`: a GPU of the searches' memory limit, a host of host_memory_bytes; `exact`: each
    probe's fake step at its own depth and length)."""

    simulate: bool = False
    exact: bool = False
    host_memory_bytes: int | None = None
    budget_s: float | None = None
    budget: str = ""  # the budget as the user gave it, for the line that says it ran out


def run_searches(searches: list[MaxlenSpec], out: Path, *, probing: Probing, resume: bool, steps: Steps) -> Outcome:
    """Each search in turn; the outcome holds the answers of those that finished."""
    outcome = Outcome()
    run = _searcher(searches[0], out, probing, steps, outcome.seeds)
    for search in searches:
        steps.start(f"{search.method}: searching")

        def told(row: ResultRow, method: str = search.method) -> None:
            outcome.probes.append(row)
            steps.note(f"{method}: probe {point_line(row)}")

        try:
            answer = run(search, resume=resume, on_probe=told)
        except ProbeFailed as error:
            outcome.failed = f"{error}; probes so far are in {out}"
            return outcome
        except BudgetSpent as spent:
            left = len(searches) - len(outcome.rows)
            outcome.stopped = (
                f"--budget {probing.budget} spent in {search.method}'s search ({spent}): {left} of "
                f"{len(searches)} search(es) left; probes so far are in {out}; run the same command to resume"
            )
            return outcome
        except KeyboardInterrupt:
            outcome.interrupted = f"interrupted: probes so far are in {out}; run the same command to resume"
            return outcome
        outcome.rows.append(answer)
        why = f": {answer.error}" if answer.status == "oom" and answer.error else ""  # not even the shortest fits
        steps.advance(f"{search.method}: max T {seq_bound(answer)}{why} ({answer.num_probes} probes)")
    return outcome


def _searcher(first: MaxlenSpec, out: Path, probing: Probing, steps: Steps, seeds: list[ResultRow]):
    """search(spec, **options) -> answer row, probing as `probing` says (the seed's prediction is
    for this machine's device: its capacity caps a memory limit as a probe's cap does); each seed
    predicted and stored in `out` is appended to `seeds`."""
    from ..measure.environment import capture_environment
    from .budget import Budget, within  # looked up at the call: tests stand in a clock of their own
    from .isolated import run_isolated
    from .maxlen import find_max_len
    from .simulated_search import estimate_seed, simulated_max_len, simulated_probing

    if probing.simulate:
        kwargs = simulated_probing(
            target="cuda",
            memory_bytes=first.base.memory_limit,
            host_memory_bytes=probing.host_memory_bytes,
            exact=probing.exact,
            note=steps.note,
        )
        return lambda search, **options: simulated_max_len(search, out, probing=kwargs, exact=probing.exact, **options)
    env = capture_environment(first.base.device)
    clock = Budget(probing.budget_s) if probing.budget_s is not None else None
    measure = within(run_isolated, clock) if clock else run_isolated

    def predicted(row: ResultRow, stored: bool) -> None:
        if not stored:
            seeds.append(row)

    seed = estimate_seed(
        capacity_bytes=env.device_total_memory_bytes, budget=clock, note=steps.note, out=out, on_row=predicted
    )
    return lambda search, **options: find_max_len(search, out, env=env, measure=measure, seed=seed, **options)
