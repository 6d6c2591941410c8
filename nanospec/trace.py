"""The Frozen-KV MTP lifecycle trace (``LLM(trace=...)``), a layer beside the core: a callable
``(step, event, fields)`` receives every event of the lifecycle, ``trace=True`` prints them
(``print_event``). The events: "prefill_done" and "release" per request (``PersistentBatch``), "draft_len" per
speculative step and "draft" / "verify" per request of it (``speculative_step``). Without a trace nothing here
runs; with one each speculative step reads its tokens on the host at launch, so a traced engine does not
overlap steps."""


def print_event(step: int, event: str, fields: dict) -> None:
    """``trace=True``: one line per lifecycle event."""
    print(f"[step {step}] {event:<12} " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def speculative_step(trace, reqs, s: int, expected: float, estimate, lens, tree_tokens, emitted) -> None:
    """The events of one speculative step: "draft_len" (the draft length ``s``, the batch size, the policy's
    ``expected`` accept length and its throughput ``estimate`` in tokens/s, or None), then per request
    "draft" (its committed length L, ``lens[i]``, and the tokens drafted after its bonus token,
    ``tree_tokens[i][1:]``) and "verify" (the KV rows the verify wrote, the drafts accepted, the bonus token,
    the accept length and the new committed length; ``emitted[i]``: the tokens it emitted)."""
    tok_per_s = None if estimate is None else round(estimate, 1)
    trace(
        "draft_len",
        {"s": s, "batch": len(reqs), "expected_accept": round(expected, 3), "tok_per_s": tok_per_s},
    )
    for r, L, tokens, out in zip(reqs, lens, tree_tokens, emitted):
        trace("draft", {"req": r.request_id, "L": L, "tokens": tokens[1:]})
        verify = {
            "req": r.request_id,
            "kv_rows": (L, L + len(tokens)),
            "accepted": out[:-1],
            "bonus": out[-1],
            "accept_length": len(out),
            "committed_L": L + len(out),
        }
        trace("verify", verify)
