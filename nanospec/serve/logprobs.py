"""Logprobs in the OpenAI answer shapes, from the engine's logprob dicts ({token id: logprob}: the top k in
descending order, then the token itself when it is not among them; ``SamplingParams.logprobs``)."""


def completion_logprobs(tok, ids: list[int], entries: list, offset: int = 0) -> dict:
    """The completions ``logprobs`` object of tokens ``ids`` with their engine logprob dicts (None: no
    context, the prompt's first token): tokens, token_logprobs, top_logprobs (token text -> logprob: the top
    k, then the token itself when it is not among them, as vLLM), text_offset (from ``offset``)."""
    out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entry in zip(ids, entries):
        text = tok.decode([token_id])
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry[token_id])
        top = None if entry is None else {tok.decode([t]): lp for t, lp in entry.items()}
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tok, ids: list[int], entries: list, k: int) -> list[dict]:
    """The chat ``logprobs.content`` list: {token, logprob, bytes, top_logprobs: the top k}."""

    def item(token_id, lp):
        text = tok.decode([token_id])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(ids, entries):
        top = [item(t, lp) for t, lp in list(entry.items())[:k]]
        content.append(item(token_id, entry[token_id]) | {"top_logprobs": top})
    return content
