"""The Frozen-KV MTP lifecycle trace (``LLM(trace=...)``), a layer beside the core: a callable
``(step, event, fields)`` receives every event of the lifecycle; ``trace=True`` shows them as text
(``TextView``), ``trace=print_event`` as token ids. The events: "prefill_done" and "release" per request
(``PersistentBatch``), "draft_len" per speculative step and "draft" / "verify" per request of it
(``speculative_step``). Without a trace nothing here runs; with one each speculative step reads its tokens on
the host at launch, so a traced engine does not overlap steps."""

import sys
from collections import Counter


def print_event(step: int, event: str, fields: dict) -> None:
    """``trace=print_event``: one line per lifecycle event, its fields as they are (token ids)."""
    print(f"[step {step}] {event:<12} " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def speculative_step(trace, reqs, s: int, tree: bool, expected: float, estimate, lens, tree_tokens, emitted):
    """The events of one speculative step: "draft_len" (the draft length ``s``, the batch size, the policy's
    ``expected`` accept length and its throughput ``estimate`` in tokens/s, or None), then per request
    "draft" (its committed length L, ``lens[i]``, the tokens drafted after its bonus token,
    ``tree_tokens[i][1:]``, in tree order when ``tree``, else a chain) and "verify" (the KV rows the verify
    wrote, the drafts accepted, the bonus token, the accept length and the committed length after it; a stop
    or ``max_tokens`` may keep fewer of ``emitted[i]``, the tokens it emitted)."""
    tok_per_s = None if estimate is None else round(estimate, 1)
    draft_len = {"s": s, "batch": len(reqs), "expected_accept": round(expected, 3), "tok_per_s": tok_per_s}
    trace("draft_len", draft_len)
    for r, L, tokens, out in zip(reqs, lens, tree_tokens, emitted):
        trace("draft", {"req": r.request_id, "L": L, "tokens": tokens[1:], "tree": tree})
        verify = {
            "req": r.request_id,
            "kv_rows": (L, L + len(tokens)),
            "accepted": out[:-1],
            "bonus": out[-1],
            "accept_length": len(out),
            "committed_L": L + len(out),
        }
        trace("verify", verify)


# Marks of a verify step's tokens in plain text, and their ANSI colours in a terminal.
MARKS = {"accepted": "+", "rejected": "x", "unreached": ".", "bonus": ">"}
COLOURS = {"accepted": "32", "rejected": "9;31", "unreached": "2", "bonus": "1;36"}


class TextView:
    """``LLM(trace=True)``: the lifecycle as text a learner reads. Each verify step is one line per request:
    the tokens it drafted, each as its text, marked accepted ``+``, rejected ``x`` (the first draft the target
    disagreed with; tokens drafted after it ``.``, never reached) and the bonus token ``>`` (the target's own
    token where the drafts stopped); in a terminal colours replace the marks (green, red struck through, grey,
    bold cyan). A tree step (``topk`` > 1) shows its accepted path, the count of its drafts and the bonus
    token. A step's line is what the verify committed, before a stop or ``max_tokens`` trims the request's
    output. ``histogram()``: the acceptance per draft position (tree: per depth) so far, accepted / drafted
    as vLLM counts it, as a text histogram. ``tokenizer``: the model's (its ``decode``); ``out``: where lines
    go (stdout); ``colour``: None to colour only when ``out`` is a terminal."""

    def __init__(self, tokenizer, out=None, colour: bool | None = None):
        self.tokenizer = tokenizer
        self.out = out or sys.stdout
        self.colour = self.out.isatty() if colour is None else colour
        self.drafts: dict[int, dict] = {}  # request id -> its "draft" event of this step
        self.draft_length = 0  # this step's s (its "draft_len" event)
        self.drafted: Counter = Counter()  # draft position (1-based) -> drafts made there
        self.accepted: Counter = Counter()  # draft position -> drafts accepted there

    def __call__(self, step: int, event: str, fields: dict) -> None:
        req = fields.get("req")
        if event == "draft":
            self.drafts[req] = fields
            return
        if event == "prefill_done":
            first = self._show(fields["bonus"], "bonus")
            line = f"req {req} prefill done, L={fields['L']}, first token {first}"
        elif event == "draft_len":
            self.draft_length = fields["s"]
            line = f"draft length {fields['s']} for {fields['batch']} request(s)"
        elif event == "release":
            line = f"req {req} released ({fields['reason']})"
        else:
            line = self._verify(req, fields)
        print(f"[step {step}] {line}", file=self.out, flush=True)

    def _verify(self, req: int, fields: dict) -> str:
        draft = self.drafts.pop(req, {"tokens": [], "tree": False})
        accepted = fields["accepted"]
        n = len(accepted)
        # a chain drafts one token per position; a tree drafts at depths 1..s, its nodes shown only as a count
        depths = self.draft_length if draft["tree"] else len(draft["tokens"])
        self.drafted.update(range(1, depths + 1))
        self.accepted.update(range(1, n + 1))
        shown = [self._show(t, "accepted") for t in accepted]
        if draft["tree"]:
            shown.append(f"(a tree of {len(draft['tokens'])} drafts)")
        else:
            for j, token in enumerate(draft["tokens"][n:], n):
                shown.append(self._show(token, "rejected" if j == n else "unreached"))
        shown.append(self._show(fields["bonus"], "bonus"))
        L = fields["kv_rows"][0]
        after = f"accept_length {fields['accept_length']}, L={fields['committed_L']}"
        return f"req {req} L={L}: {' '.join(shown)}  {after}"

    def _show(self, token: int, kind: str) -> str:
        text = repr(self.tokenizer.decode([token]))
        if self.colour:
            return f"\033[{COLOURS[kind]}m{text}\033[0m"
        return MARKS[kind] + text

    def histogram(self, width: int = 30) -> str:
        """The acceptance per draft position of the chain steps seen so far: a bar of ``width`` characters per
        position (``#`` accepted, ``.`` not), the rate and the counts."""
        lines = ["acceptance per draft position (accepted / drafted):"]
        for j in sorted(self.drafted):
            rate = self.accepted[j] / self.drafted[j]
            bar = "#" * round(rate * width)
            lines.append(f"  {j:2d}  {bar:.<{width}}  {rate:.2f}  ({self.accepted[j]}/{self.drafted[j]})")
        return "\n".join(lines)
