"""The kernel specializations the engine launches are the ones recorded in scripts/kernel_specs.json (which
.ci/run then compiles for sm_80, sm_86, sm_89 and sm_90: `kernel_specs.py check`, shared memory and spills
included); the recorder sees what the interpreter launches; the attention tile policy's branches match the
torch references under the interpreter."""

import json
import pathlib
import sys
import time

import pytest
import torch

from nanospec.kernels import attention as A
from nanospec.kernels import attention_common

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import kernel_specs as ks  # noqa: E402

MICRO = ("micro-fp32-p16-chain-dense", "micro", "float32", 16, "dense", dict(num_steps=2))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    t0 = time.perf_counter()
    specs = ks.record(tmp=tmp_path_factory.mktemp("kernel_specs"))
    print(f"recorded {len(specs)} specializations in {time.perf_counter() - t0:.0f} s")
    return specs


def test_specs_json_is_current(recorded):
    note = ks.version_note()  # another Triton launches other specializations: say that, not which differ
    if note:
        pytest.fail(note)
    committed = {ks.spec_key(s): s for s in ks.load_specs()}
    fresh = {ks.spec_key(s): s for s in recorded}
    stale = "; regenerate with `python scripts/kernel_specs.py record`"
    assert sorted(set(fresh) - set(committed))[:3] == [], "launched but not in kernel_specs.json" + stale
    assert sorted(set(committed) - set(fresh))[:3] == [], "in kernel_specs.json but not launched" + stale
    for k, s in fresh.items():
        assert committed[k]["archs"] == s["archs"] and committed[k]["phases"] == s["phases"], stale


def test_every_kernel_is_recorded(recorded):
    # every @triton.jit kernel of nanospec.kernels (the *_kernel functions; the rest are device functions)
    import importlib
    import pkgutil

    import nanospec.kernels as K

    defined = set()
    for info in pkgutil.iter_modules(K.__path__):
        mod = importlib.import_module(f"{K.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and hasattr(obj, "fn") and hasattr(obj, "run"):
                defined.add(f"{mod.__name__}:{name}")
    assert len(defined) >= 8
    assert defined == {s["kernel"] for s in recorded}
    phases = {p for s in recorded for p in s["phases"]}
    assert phases == {"prefill", "decode", "verify", "draft", "other"}
    assert {a for s in recorded for a in s["archs"]} == {80, 86, 89, 90}


def test_dry_launches_record_what_the_interpreter_launches(tmp_path):
    # the recorder's dry launches (torch reference results) see exactly the launches of a real interpreted run
    dry = ks.record([MICRO], tmp=tmp_path, classes={101376: (89,)}, prompt_lens=(5, 20))
    real = ks.record([MICRO], tmp=tmp_path, classes={101376: (89,)}, prompt_lens=(5, 20), execute=True)
    assert len(dry) >= 10
    assert [ks.spec_key(s) for s in dry] == [ks.spec_key(s) for s in real]
    assert [s["phases"] for s in dry] == [s["phases"] for s in real]


def test_fast_subset_keeps_every_kernel(recorded):
    # `kernel_specs.py check --fast` (one spec per tile configuration) still compiles every kernel; .ci/run
    # compiles every spec for all four archs after pytest (`kernel_specs.py check`), so pytest compiles none
    fast = ks.representatives(recorded)
    assert {s["kernel"] for s in fast} == {s["kernel"] for s in recorded} and len(fast) < len(recorded)


# ---- the tile policy: every branch, and the kernels with those tiles against the references ------------

# (dtype, head_dim, smem) -> (BLOCK_D, BLOCK_N, BLOCK_M cap, num_warps, num_stages), causal and with a tree
TILES = [
    (torch.bfloat16, 64, 101376, (64, 64, 64, 4, 3), (64, 64, 32, 4, 3)),
    (torch.bfloat16, 128, 101376, (128, 64, 64, 4, 3), (128, 32, 32, 8, 3)),
    (torch.float32, 64, 101376, (64, 32, 32, 4, 3), (64, 32, 32, 4, 3)),
    (torch.float32, 128, 166912, (128, 16, 32, 8, 3), (128, 16, 32, 8, 3)),
    (torch.bfloat16, 256, 166912, (256, 16, 32, 8, 3), (256, 16, 32, 8, 3)),
    (torch.float32, 256, 101376, (256, 16, 32, 8, 3), (256, 16, 32, 8, 3)),
    (torch.bfloat16, 512, 166912, (512, 32, 32, 8, 3), (512, 32, 32, 8, 3)),
    (torch.float16, 512, 101376, (512, 16, 32, 8, 3), (512, 16, 32, 8, 3)),
    (torch.float32, 512, 232448, (512, 16, 32, 8, 1), (512, 16, 32, 8, 1)),
    (torch.float32, 512, 101376, (512, 16, 16, 8, 2), (512, 16, 16, 8, 2)),
]


@pytest.fixture
def tile_target():
    old = attention_common.tile_target()
    yield A.set_tile_target
    A.set_tile_target(old)


@pytest.mark.parametrize("dtype,d,smem,causal,tree", TILES)
def test_tile_branches_match_reference(dtype, d, smem, causal, tree, tile_target):
    from test_kernels_attention import extend_inputs, make_paged

    tile_target(smem)
    q = torch.zeros(1, 1, d, dtype=dtype)
    tiles = attention_common.attention_tiles
    assert (tiles(q), tiles(q, tree=True)) == (causal, tree)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # causal prefill over a paged prefix (several key tiles), a tree verify, and split-KV decode with a map
    lens, ns = [40, 9], [7, 9]
    q, kc, vc, bt, cu, sl, _, _, _ = extend_inputs(lens, ns, 4, 2, d, 16, dtype, seed=d)
    got = A.extend_attention_triton(q, kc, vc, bt, cu, sl, d**-0.5, 9)
    ref = A.extend_attention_ref(q, kc, vc, bt, cu, sl, d**-0.5, 9)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    q, kc, vc, bt, cu, sl, tm, _, _ = extend_inputs([12, 21], [4, 4], 4, 2, d, 16, dtype, seed=1, tree=True)
    got = A.extend_attention_triton(q, kc, vc, bt, cu, sl, 0.05, 4, tree_mask=tm)
    ref = A.extend_attention_ref(q, kc, vc, bt, cu, sl, 0.05, 4, tree_mask=tm)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    kc, vc, bt, _, _ = make_paged([37, 5], 2, d, 16, dtype, seed=2)
    sl, r2r = torch.tensor([37, 5], dtype=torch.int32), torch.tensor([0, 1, 0], dtype=torch.int32)
    qd = torch.randn(3, 4, d).to(dtype)
    got = A.decode_attention_triton(qd, kc, vc, bt, sl, d**-0.5, r2r, 2)
    ref = A.decode_attention_ref(qd, kc, vc, bt, sl, d**-0.5, r2r)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("bad", [1024, 2.0e5, True, "99KB"])
def test_set_tile_target_rejects(bad, tile_target):
    with pytest.raises(ValueError, match="smem"):
        tile_target(bad)


def test_version_note(tmp_path):
    import triton

    path = tmp_path / "specs.json"
    path.write_text(json.dumps({"triton": triton.__version__, "specs": []}))
    assert ks.version_note(path) is None
    path.write_text(json.dumps({"triton": "0.0.1", "specs": []}))
    note = ks.version_note(path)
    assert f"recorded with Triton 0.0.1 but Triton {triton.__version__} is installed" in note
    assert "triton==0.0.1" in note and "kernel_specs.py record" in note


def test_cuda_default_verify_tile_and_graph_splits_recorded(recorded):
    """The CUDA default (SmolLM2 bf16, 5 steps, adaptive): the verify of 6 rows x 3 query heads per KV head
    packs 32-row tiles; graph-bucketed decode takes num_kv_splits(4096) = 16 splits (divisible by 16)."""
    from nanospec.kernels.attention import num_kv_splits

    name = "smollm2-bf16-p16-chain-cuda-default"
    mine = [s for s in recorded if name in s["workloads"]]
    verify = [s for s in mine if s["kernel"].endswith(":_extend_kernel") and "verify" in s["phases"]]
    assert {s["constexprs"]["BLOCK_M"] for s in verify} == {16, 32}  # s = 0..4 and s = 5
    assert num_kv_splits(4096) == 16
    split = [s for s in mine if s["kernel"].endswith(":_decode_split_kernel")]
    assert any(dict((n, a) for n, _, a in s["args"])["num_splits"] == "D" for s in split)


def test_moe_kernels_recorded_at_26b_geometry(recorded):
    moe = [s for s in recorded if s["kernel"].startswith("nanospec.kernels.moe:")]
    gemm = [s for s in moe if s["kernel"].endswith("_moe_gemm_kernel")]
    assert {s["constexprs"]["BLOCK_M"] for s in gemm} == {16, 32, 64}  # decode and prefill tiles, fp32 too
    assert {p for s in gemm for p in s["phases"]} >= {"prefill", "decode", "verify"}
    route = [s for s in moe if s["kernel"].endswith("_route_kernel")]
    assert {(s["constexprs"]["BLOCK_E"], s["constexprs"]["TOP_K"]) for s in route} == {(128, 8)}


def test_specs_json_lists_archs_and_phases():
    data = json.loads(ks.SPECS_JSON.read_text())
    assert data["triton"] and data["specs"]
    assert all(set(s["archs"]) <= set(ks.LIMITS) and s["phases"] for s in data["specs"])
