"""SPRINT (interleaved planning and parallel execution) as an SGLang frontend program.

Each round the planner writes a <Plan> announcing k tasks (<Task id=K> with a generated prompt), the
program forks k executors (each sees the cumulative context, the plan and its own
"<Execution id=K>\\n" header, as the server-side grammar gives it), joins their outputs in task order
exactly as the server's reduce does, and the planner writes the next plan; after the last round it
writes the <Answer>. A SPRINT detector follows the parent's text and checks every round.

    python -m frontends.sprint --url http://127.0.0.1:30000 --rounds 2 --tasks 3
"""

from __future__ import annotations

import argparse
from dataclasses import astuple, dataclass, field
from typing import Any

from branchwise.fork import phases
from branchwise.fork.grammars import Mode, PhaseOpened, SprintDetector, SprintTags
from frontends.common import (
    ProgramResult,
    RequestRecord,
    add_common_args,
    backend,
    gen_kwargs,
    print_result,
    prompt,
    sgl,
    tag_stops,
    use_hook,
)

_T = SprintTags()
STOPS = tag_stops([t for t in astuple(_T) if t != _T.id_attr])


@dataclass(slots=True)
class SprintResult(ProgramResult):
    rounds: list[list[str]] = field(default_factory=list)  # per round: executor outputs, task order


def _text(s: Any) -> str:
    return s.text()  # syncs: the detector follows exactly what the parent holds


@sgl.function
def sprint_program(s: Any, question: str, rounds: int, tasks: int, plan_tokens: int, task_tokens: int,
                   exec_tokens: int, answer_tokens: int, temp: float) -> Any:
    det = SprintDetector(mode=Mode.PARENT)
    s += question + "\n"
    fed = len(_text(s))  # the grammar follows generated text only, as on the server
    outputs: list[list[str]] = []
    for r in range(rounds):
        s += f"<{_T.plan}>\n" + sgl.gen(f"plan{r}", **gen_kwargs(plan_tokens, temp, STOPS)) + "\n"
        for k in range(tasks):
            s += f"<{_T.task} {_T.id_attr}={k + 1}>\n"
            s += sgl.gen(f"task{r}.{k}", **gen_kwargs(task_tokens, temp, [*STOPS, "\n"]))
            s += f"\n</{_T.task}>\n"
        s += f"</{_T.plan}>\n"
        text = _text(s)
        s.set_var(f"_fork{r}", text)
        fork = next(e for e in det.feed(text[fed:]) if isinstance(e, PhaseOpened))
        fed = len(text)
        forks = s.fork(fork.n)
        for i in range(fork.n):
            forks[i] += fork.headers[i]
            forks[i] += sgl.gen("exec", **gen_kwargs(exec_tokens, temp, STOPS))
        forks.join()
        # task order, "</Execution>" closed
        reduce = phases.reduce(det.fmt, fork.headers, [forks[i]["exec"] for i in range(fork.n)])
        det.join(reduce)
        s += reduce
        fed += len(reduce)
        outputs.append([f["exec"] for f in forks.states])
        s.set_var(f"_meta{r}", [f.get_meta_info("exec") for f in forks.states])
    s += f"<{_T.answer}>\n" + sgl.gen("answer", **gen_kwargs(answer_tokens, temp, STOPS))
    s += f"\n</{_T.answer}>\n"
    det.feed(_text(s)[fed:])
    det.finish()  # raises GrammarError if the text is not well-formed SPRINT
    return outputs


def run(url: str, *, rounds: int = 2, tasks: int = 3, question: str | None = None, plan_tokens: int = 16,
        task_tokens: int = 8, exec_tokens: int = 32, answer_tokens: int = 16, temperature: float = 0.0,
        hook: bool = True, seed: int = 0, endpoint: Any = None) -> SprintResult:
    if rounds < 1 or tasks < 1:
        raise ValueError(f"rounds and tasks must be >= 1, got {rounds}, {tasks}")
    use_hook(hook)
    state = sprint_program.run(
        question=question or prompt(seed), rounds=rounds, tasks=tasks, plan_tokens=plan_tokens,
        task_tokens=task_tokens, exec_tokens=exec_tokens, answer_tokens=answer_tokens,
        temp=temperature, backend=endpoint or backend(url))
    if state.error() is not None:
        raise RuntimeError(f"sprint program failed: {state.error()!r}")
    recs = []
    for r in range(rounds):
        recs.append(RequestRecord.of(f"plan{r}", state.get_meta_info(f"plan{r}")))
        recs += [RequestRecord.of(f"task{r}.{k}", state.get_meta_info(f"task{r}.{k}")) for k in range(tasks)]
        recs += [RequestRecord.of(f"exec{r}.{i}", m, r) for i, m in enumerate(state[f"_meta{r}"])]
    recs.append(RequestRecord.of("answer", state.get_meta_info("answer")))
    return SprintResult(state.text(), recs, [state[f"_fork{r}"] for r in range(rounds)], state.ret_value)


def main(argv: list[str] | None = None) -> None:
    p = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tasks", type=int, default=3)
    p.add_argument("--exec-tokens", type=int, default=32)
    a = p.parse_args(argv)
    res = run(a.url, rounds=a.rounds, tasks=a.tasks, exec_tokens=a.exec_tokens, temperature=a.temperature,
              hook=not a.stock, seed=a.seed)
    print_result(res, "sprint")


if __name__ == "__main__":
    main()
