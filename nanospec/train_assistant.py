"""Distill a Frozen-KV MTP assistant (HF ``gemma4_assistant``) for a frozen target (DESIGN §6).

    python -m nanospec.train_assistant [--target DIR] [--layers 1] [--num-steps 5] [--seq-len 256]
        [--max-tokens N] [--time-budget-min M] [--out DIR] ...

Data: ShareGPT train split (``nanospec.datasets``), one sequence per (user, assistant) turn pair through the
target's chat template (user turn clipped, whole sequence truncated to ``--seq-len``), original responses.

Per batch the frozen target runs ONE forward through nanospec's own paged pool (a scratch pool, one block per
sequence), and the trainer reads back the mapped layer's K/V exactly as stored (after RoPE) plus the post-final-norm
hidden states. Then, for sampled committed lengths L (any number at once, the ordinary causal mask), the assistant
is unrolled S steps exactly as ``nanospec.spec.draft.run_draft`` runs them (topk 1): step 1 input
``(x_L, h_{L-1})``, step s input ``(x_{L+s-1}, h_next of step s-1)``, every step at RoPE position
``L + position_offset`` (default L-1) over K/V rows ``[0, L)``. Loss of step s = KL(p_target(. | row L+s-1) ||
q_assistant) (+ optional CE on x_{L+s}), weighted ``step_decay ** (s-1)``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .context import AttnMetadata, attn_metadata
from .kernels import using_backend
from .models.gemma4_assistant import Gemma4Assistant, assistant_config_for


# ---------------------------------------------------------------------------------------------- the target
@torch.no_grad()
def capture_target(target, seqs: list[list[int]], layers: list[int]):
    """One prefill of every sequence through ``target`` over a scratch paged pool (one block per sequence).

    Returns ``tokens [B, T]`` (0-padded), ``lens [B]``, ``hidden [B, T, Hb]`` (post-final-norm) and ``kv``: per
    assistant layer a pair ``(k, v)`` of ``[B, T, Hkv, D]``, the mapped target layer's rows as stored in the cache.
    """
    dev = target.embed_tokens.weight.device
    dtype = target.embed_tokens.weight.dtype
    B, T = len(seqs), max(len(s) for s in seqs)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=dev)
    pool = torch.zeros(len(target.layers), 2, B + 1, T, target.num_kv_heads, target.head_dim, dtype=dtype, device=dev)
    target.bind_kv_cache(pool)  # block 0 stays unused, as in the engine
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    pos = torch.cat([torch.arange(len(s), device=dev) for s in seqs])
    slots = torch.cat([(b + 1) * T + torch.arange(len(s), device=dev) for b, s in enumerate(seqs)])
    cu = torch.tensor([0] + [len(s) for s in seqs], device=dev).cumsum(0).to(torch.int32)
    bt = torch.arange(1, B + 1, dtype=torch.int32, device=dev)[:, None]
    with attn_metadata(AttnMetadata("prefill", bt, lens, slots, cu, T)):
        flat = target(ids, pos)
    hidden = flat.new_zeros(B, T, flat.shape[-1])
    tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
    mask = torch.arange(T, device=dev)[None] < lens[:, None]
    hidden[mask], tokens[mask] = flat, ids
    kv = [(pool[i, 0, 1:].clone(), pool[i, 1, 1:].clone()) for i in layers]
    target.bind_kv_cache(pool[:, :, :1])  # drop the big views; the engine rebinds its own pool
    return tokens, lens.long(), hidden, kv


# ------------------------------------------------------------------------------------------ the unrolled draft
def dense_attn_fn(kv, Ls):
    """``attn_fn`` for ``Gemma4Assistant.forward``: query row (b, i) sees K/V rows ``[0, Ls[b, i])`` of sequence
    b at its mapped layer; scale 1.0, GQA by repetition (what ``draft_attention`` computes over the pool)."""
    B, n = Ls.shape
    T = kv[0][0].shape[1]
    mask = torch.arange(T, device=Ls.device)[None, None] < Ls[..., None]  # [B, n, T]

    def attn(layer_idx, q):
        k, v = kv[layer_idx]
        Hq, D, Hkv = q.shape[1], q.shape[2], k.shape[2]
        qb = q.view(B, n, Hkv, Hq // Hkv, D)
        s = torch.einsum("bnkgd,btkd->bkgnt", qb, k.to(q.dtype))
        p = torch.softmax(s.float().masked_fill(~mask[:, None, None], float("-inf")), -1).to(q.dtype)
        return torch.einsum("bkgnt,btkd->bnkgd", p, v.to(q.dtype)).reshape(B * n, Hq, D)
    return attn


def unroll(assistant, tokens, hidden, kv, Ls, num_steps: int, position_offset: int = -1):
    """Run ``num_steps`` draft steps for committed lengths ``Ls [B, n]`` (1 <= L < len) with teacher tokens.

    Step s (1-based) feeds ``tokens[b, L+s-1]`` (clamped at the sequence end) and, for s = 1, ``hidden[b, L-1]``,
    else the previous step's ``h_next``. Returns ``[(logits [B*n, V] fp32, h_next [B*n, Hb])]`` per step.
    """
    B, n = Ls.shape
    T = tokens.shape[1]
    b = torch.arange(B, device=Ls.device)[:, None].expand(B, n)
    pos = (Ls + position_offset).clamp(min=0).reshape(-1)
    attn = dense_attn_fn(kv, Ls)
    h = hidden[b, Ls - 1].reshape(B * n, -1)
    outs = []
    for s in range(1, num_steps + 1):
        tok = tokens[b, (Ls + s - 1).clamp(max=T - 1)].reshape(-1)
        logits, h = assistant(tok, h, pos, attn_fn=attn)
        outs.append((logits, h))
    return outs


def distill_loss(assistant, target, tokens, lens, hidden, kv, Ls, valid, num_steps, step_decay=0.8,
                 ce_weight=0.0, position_offset=-1, vocab=None):
    """Weighted sum over steps of KL(target || assistant) (+ CE), averaged over valid (b, L, s).

    ``vocab`` (LongTensor [V'] or None): train on that vocabulary subset only (both distributions renormalised
    over it; the assistant then shares the target's LM head rows ``vocab``) to cut the LM-head cost.
    Returns ``(loss, per_step_kl list[float], per_step_top1_agreement list[float])``."""
    B, n = Ls.shape
    T = tokens.shape[1]
    b = torch.arange(B, device=Ls.device)[:, None].expand(B, n)
    head = target.lm_head_weight.detach()
    full_head = assistant._target_lm_head
    if vocab is not None:
        if full_head is None:
            raise ValueError("a vocabulary subset needs an assistant that uses the target's LM head")
        head = head[vocab]
        assistant._target_lm_head = head
        tok_map = torch.full((target.config.vocab_size,), -100, dtype=torch.long, device=Ls.device)
        tok_map[vocab] = torch.arange(vocab.numel(), device=Ls.device)
    try:
        outs = unroll(assistant, tokens, hidden, kv, Ls, num_steps, position_offset)
    finally:
        assistant._target_lm_head = full_head
    total, wsum, kls, accs = 0.0, 0.0, [], []
    for s, (logits, _) in enumerate(outs, start=1):
        row = Ls + s - 1  # the target row whose distribution predicts token L+s
        m = (valid & (row < lens[:, None])).reshape(-1).float()
        with torch.no_grad():
            t_logp = torch.log_softmax(F.linear(hidden[b, row.clamp(max=T - 1)].reshape(B * n, -1), head).float(), -1)
        a_logp = torch.log_softmax(logits, -1)
        kl = (t_logp.exp() * (t_logp - a_logp)).sum(-1)
        denom = m.sum().clamp(min=1)
        step = (kl * m).sum() / denom
        if ce_weight:
            nxt = tokens[b, (row + 1).clamp(max=T - 1)].reshape(-1)
            mc = m * (row + 1 < lens[:, None]).reshape(-1).float()
            if vocab is not None:
                nxt = tok_map[nxt]
                mc = mc * (nxt >= 0).float()
            ce = F.nll_loss(a_logp, nxt.clamp(min=0), reduction="none")
            step = step + ce_weight * (ce * mc).sum() / mc.sum().clamp(min=1)
        w = step_decay ** (s - 1)
        total, wsum = total + w * step, wsum + w
        kls.append(float((kl.detach() * m).sum() / denom))
        accs.append(float(((a_logp.argmax(-1) == t_logp.argmax(-1)).float() * m).sum() / denom))
    return total / wsum, kls, accs


def sample_positions(lens, n: int, generator=None):
    """``Ls [B, n]`` committed lengths drawn uniformly from ``[1, len-1]`` (without replacement where possible)
    and ``valid [B, n]``."""
    B = lens.shape[0]
    r = torch.rand(B, int(lens.max()), generator=generator).to(lens.device)  # CPU generator: same draws anywhere
    r[torch.arange(r.shape[1], device=lens.device)[None] >= (lens - 1)[:, None]] = 2.0  # only L-1 in [0, len-2]
    idx = r.argsort(-1)[:, :n]
    valid = r.gather(1, idx) < 2.0
    return torch.where(valid, idx + 1, torch.ones_like(idx)), valid


# --------------------------------------------------------------------------------------- init / save / load
@torch.no_grad()
def init_assistant(assistant, seed: int = 0) -> None:
    """Sensible start: x = pre_projection(cat(e, h)) ~ h + small(e); residual branches start small (post norms
    0.1); q_norm = 1/sqrt(D) so the scale-1.0 scores q.k start at the usual q.k/sqrt(D) magnitude (the target's
    K is not normalised); layer_scalar 1; final norm 1; post_projection = identity when square, else random."""
    g = torch.Generator().manual_seed(seed)
    for name, p in assistant.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
        else:
            p.fill_(1.0)
    H, Hb = assistant.hidden_size, assistant.backbone_hidden_size
    pre = assistant.pre_projection.weight  # [H, 2 Hb]
    pre.mul_(0.1)
    if H == Hb:
        pre[:, Hb:] += torch.eye(H)
        assistant.post_projection.weight.copy_(torch.eye(H) + 0.01 * torch.randn(H, H, generator=g))
    for layer in assistant.model.layers:
        layer.self_attn.q_norm.weight.fill_(layer.self_attn.head_dim ** -0.5)
        layer.post_attention_layernorm.weight.fill_(0.1)
        layer.post_feedforward_layernorm.weight.fill_(0.1)
        layer.layer_scalar.fill_(1.0)


def hf_state_dict(assistant) -> dict[str, torch.Tensor]:
    """Parameters under HF ``Gemma4AssistantForCausalLM`` names (gate_up_proj unpacked to gate_proj / up_proj)."""
    out = {}
    for name, p in assistant.named_parameters():
        t = p.detach().cpu().contiguous()
        if name.endswith("gate_up_proj.weight"):
            i = t.shape[0] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = t[:i].clone()
            out[name.replace("gate_up_proj", "up_proj")] = t[i:].clone()
        else:
            out[name] = t
    return out


def save_checkpoint(assistant, out_dir, info: dict | None = None, max_mb: float = 16.0) -> pathlib.Path:
    """Write config.json + model.safetensors (+ training_info.json) into ``out_dir``; each file is replaced
    atomically, so a killed run leaves the previous complete checkpoint. fp32 if it fits ``max_mb``, else bf16."""
    from safetensors.torch import save_file

    d = pathlib.Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    sd = hf_state_dict(assistant)
    if sum(t.numel() * 4 for t in sd.values()) > max_mb * 2**20:
        sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}

    def replace(name, write):
        tmp = d / f".{name}.tmp"
        write(tmp)
        os.chmod(tmp, 0o644)  # package data: readable by everyone
        os.replace(tmp, d / name)
    replace("model.safetensors", lambda p: save_file(sd, str(p), metadata={"format": "pt"}))
    cfg = assistant.config.to_dict()
    cfg.pop("dtype", None)
    cfg["dtype"] = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    replace("config.json", lambda p: p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n"))
    if info is not None:
        replace("training_info.json", lambda p: p.write_text(json.dumps(info, indent=2) + "\n"))
    return d


def new_assistant(target, layers=1, hidden_size=None, intermediate_size=None, use_target_lm_head=True, seed=0):
    cfg = assistant_config_for(target.config, num_layers=layers, hidden_size=hidden_size,
                               intermediate_size=intermediate_size, use_target_lm_head=use_target_lm_head)
    assistant = Gemma4Assistant(cfg)
    init_assistant(assistant, seed)
    assistant.to(hidden_dev(target)).bind_target(target, kv=False)
    return assistant


# ------------------------------------------------------------------------------------------------- training
def train(target, seqs, out_dir=None, layers=1, num_steps=5, batch_size=8, positions_per_seq=64, lr=1e-3,
          warmup=30, epochs=1.0, max_tokens=None, time_budget_min=None, step_decay=0.8, ce_weight=0.0,
          save_every_min=5.0, seed=0, assistant=None, weight_decay=0.0, position_offset=-1, info=None,
          progress=True, log_every=20, amp=False, train_vocab=None):
    """Train (or continue training ``assistant``) on ``seqs``; returns ``(assistant, summary dict)``.
    ``amp``: the frozen target runs in bf16 and the assistant's GEMMs in bf16 autocast (CPUs with AVX512-BF16 /
    AMX are ~4x faster); the assistant's weights stay fp32. ``train_vocab``: train on the most frequent
    ``train_vocab`` tokens of ``seqs`` only (see ``distill_loss``); None = the full vocabulary."""
    torch.manual_seed(seed)
    target.requires_grad_(False)
    if assistant is None:
        assistant = new_assistant(target, layers, seed=seed)
    layer_map = assistant.layer_map(target.kv_layer_types)
    vocab = None
    if train_vocab and train_vocab < target.config.vocab_size:
        counts = torch.bincount(torch.tensor([t for q in seqs for t in q]), minlength=target.config.vocab_size)
        vocab = counts.argsort(descending=True, stable=True)[:train_vocab].sort().values.to(hidden_dev(target))
    frozen = target
    if amp:  # a bf16 copy of the frozen target (its RoPE table stays fp32)
        import copy
        frozen = copy.deepcopy(target).to(torch.bfloat16)
        frozen.cos_sin = target.cos_sin
    params = [p for p in assistant.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    rng = random.Random(seed)
    order = []
    while len(order) < epochs * len(seqs):
        perm = list(range(len(seqs)))
        rng.shuffle(perm)
        order += perm
    order = order[: max(1, int(epochs * len(seqs)))]
    total_steps = -(-len(order) // batch_size)
    budget_s = time_budget_min * 60 if time_budget_min else None
    gen = torch.Generator().manual_seed(seed)
    t0 = last_save = time.time()
    tokens_seen, seqs_seen, losses, summary = 0, 0, [], {}
    bar = tqdm(total=total_steps, desc="train", disable=not progress)
    step = 0
    for step in range(total_steps):
        elapsed = time.time() - t0
        if (budget_s and elapsed > budget_s) or (max_tokens and tokens_seen >= max_tokens):
            break
        frac = max(step / total_steps, elapsed / budget_s if budget_s else 0.0)
        cur = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for grp in opt.param_groups:
            grp["lr"] = cur
        batch = [seqs[i] for i in order[step * batch_size:(step + 1) * batch_size]]
        with torch.autocast(hidden_dev(target).type, torch.bfloat16, enabled=amp):
            tokens, lens, hidden, kv = capture_target(frozen, batch, layer_map)
            hidden, kv = hidden.float(), [(k.float(), v.float()) for k, v in kv]
            Ls, valid = sample_positions(lens, positions_per_seq, gen)
            with using_backend("torch"):  # gradients flow through the torch references only
                loss, kls, accs = distill_loss(assistant, target, tokens, lens, hidden, kv, Ls, valid, num_steps,
                                               step_decay, ce_weight, position_offset, vocab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens_seen, seqs_seen = tokens_seen + int(lens.sum()), seqs_seen + len(batch)
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", acc1=f"{accs[0]:.2f}",
                        accS=f"{accs[-1]:.2f}", lr=f"{cur:.1e}")
        summary = dict(steps=step + 1, sequences=seqs_seen, tokens_seen=tokens_seen,
                       final_loss=sum(losses[-20:]) / len(losses[-20:]), per_step_kl=kls, per_step_top1_agree=accs,
                       train_time_s=round(time.time() - t0, 1), **(info or {}))
        if progress and log_every and step % log_every == 0:
            tqdm.write(f"step {step} loss {summary['final_loss']:.4f} kl {[round(k, 3) for k in kls]} "
                       f"agree {[round(a, 3) for a in accs]} tokens {tokens_seen} t {summary['train_time_s']}s")
        if out_dir and time.time() - last_save > save_every_min * 60:
            save_checkpoint(assistant, out_dir, summary)
            last_save = time.time()
    bar.close()
    if out_dir:
        save_checkpoint(assistant, out_dir, summary)
    return assistant, summary


def hidden_dev(target):
    return target.embed_tokens.weight.device


def main(argv=None):
    from .loader import load_config, load_tokenizer, resolve_model_dir
    from .model_runner import build_target
    from .datasets import build_sequences, load_sharegpt, regenerate_sequences

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="HF-format target dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--num-steps", type=int, default=5, help="draft steps S unrolled in training")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--num-conversations", type=int, default=None, help="ShareGPT train conversations to use")
    ap.add_argument("--max-tokens", type=int, default=None, help="stop after this many target tokens")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--positions-per-seq", type=int, default=64, help="committed lengths L sampled per sequence")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step s is decay**(s-1)")
    ap.add_argument("--ce-weight", type=float, default=0.0)
    ap.add_argument("--time-budget-min", type=float, default=None, help="stop (and save) after M minutes")
    ap.add_argument("--save-every-min", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--amp", action="store_true", help="bf16 target + bf16 autocast (fp32 master weights)")
    ap.add_argument("--train-vocab", type=int, default=None, help="train on the N most frequent tokens only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--regenerate", default=None, metavar="TEMPS",
                    help="train on the target's own responses to the first user turns, generated by nanospec, one "
                         "round per temperature (e.g. 0,0.7); default: the original ShareGPT responses")
    ap.add_argument("--regen-budget-min", type=float, default=None, help="start no new regeneration chunk after M min")
    ap.add_argument("--max-prompt-tokens", type=int, default=192, help="--regenerate: user turn clipped to N tokens")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="--regenerate: response length cap")
    ap.add_argument("--out", default=None, help="output dir (default: the shipped asset dir for the default target)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    model_dir = resolve_model_dir(a.target)
    cfg, tok = load_config(model_dir), load_tokenizer(model_dir)
    out = a.out or (pathlib.Path(__file__).parent / "assets" / "smollm2-135m-instruct-assistant")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    convs = load_sharegpt("train", a.num_conversations)
    if a.regenerate:
        temps = [float(x) for x in a.regenerate.split(",")]
        engine = dict(max_num_seqs=512, gpu_memory_utilization=0.3) if device == "cuda" else {}
        seqs, regen = regenerate_sequences(str(model_dir), tok, convs, temps, a.max_prompt_tokens, a.max_new_tokens,
                                           a.regen_budget_min and a.regen_budget_min * 60, **engine)
        seqs = [q[:a.seq_len] for q in seqs]
        source = f"responses regenerated by the target with nanospec, temperatures {temps[:regen['rounds']]}"
        print(f"regenerated: {regen}", flush=True)
    else:
        seqs, regen, source = build_sequences(tok, convs, a.seq_len), None, "original ShareGPT responses"
    target = build_target(cfg, device, torch.float32, a.seq_len + 8, model_dir)
    if a.max_tokens:  # keep only the data we will use (the epoch order is over this subset)
        acc, keep = 0, []
        for s in seqs:
            if acc >= a.max_tokens / max(a.epochs, 1e-9):
                break
            keep.append(s)
            acc += len(s)
        seqs = keep
    hardware = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    info = dict(target=str(model_dir), data=f"ShareGPT train split, {source}", regeneration=regen,
                conversations=len(convs), num_sequences_available=len(seqs), seq_len=a.seq_len,
                num_steps=a.num_steps, layers=a.layers, lr=a.lr, batch_size=a.batch_size,
                positions_per_seq=a.positions_per_seq, step_decay=a.step_decay, ce_weight=a.ce_weight, amp=a.amp,
                train_vocab=a.train_vocab, hardware=hardware)
    print(f"data: {len(convs)} conversations -> {len(seqs)} sequences, {sum(map(len, seqs))} tokens "
          f"({source})", flush=True)
    _, summary = train(target, seqs, out, a.layers, a.num_steps, a.batch_size, a.positions_per_seq, a.lr,
                       a.warmup, a.epochs, a.max_tokens, a.time_budget_min, a.step_decay, a.ce_weight,
                       a.save_every_min, a.seed, info=info, amp=a.amp, train_vocab=a.train_vocab)
    print(f"done: {summary.get('steps', 0)} steps, {summary.get('sequences', 0)} sequences, "
          f"{summary.get('tokens_seen', 0)} tokens seen, final loss {summary.get('final_loss', float('nan')):.4f}, "
          f"train time {summary.get('train_time_s', 0):.0f} s (total {time.time() - t0:.0f} s), data: {source}; "
          f"checkpoint -> {out}", flush=True)


if __name__ == "__main__":
    main()
