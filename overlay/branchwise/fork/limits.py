"""Which client requests branch server-side, and how much one request's forks may take."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from branchwise.fork.phases import PhaseRegistry, fork_limit_error

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import Req


@dataclass(frozen=True, slots=True, kw_only=True)
class ForkLimits:
    max_fanout: int
    max_branch_tokens: int

    def refusal(self, reg: PhaseRegistry, rid: str, grants: Sequence[int]) -> str | None:
        """Why `rid` may not fork into branches granted `grants` decode tokens, or None."""
        return fork_limit_error(len(grants), grants, held(reg, reg.root_of(rid)), self.max_fanout,
                                self.max_branch_tokens)


def held(reg: PhaseRegistry, root_rid: str) -> int:
    """Decode tokens granted to the live branches (and the forks about to spawn) of one request."""
    return sum(phase.granted() for phase in reg.subtree(root_rid))


def unsupported(req: Req, recv_req: TokenizedGenerateReqInput) -> bool:
    """Requests whose output a server-side fork could not reproduce: they run serially."""
    params = req.sampling_params
    return bool(req.return_logprob or req.return_hidden_states or req.input_embeds is not None
                or getattr(recv_req, "mm_inputs", None) is not None or req.session is not None
                or req.lora_id
                or params.json_schema or params.regex or params.ebnf or params.structural_tag
                or (params.beam_width or 1) > 1)


def grammar_for(default: str | None, req: Req, recv_req: TokenizedGenerateReqInput,
                stats: Counter[str]) -> str | None:
    """The grammar to watch a new client request with, or None (serial). `default`: the server's
    --branch-grammar, for requests that do not name one."""
    meta = getattr(req, "bw_meta", None)
    if meta is None or meta.is_branch or req.to_finish is not None:
        return None
    grammar = meta.grammar if meta.grammar is not None else default
    if grammar in (None, "none"):
        return None
    if unsupported(req, recv_req):
        stats["not_branched_unsupported"] += 1
        return None
    return grammar
