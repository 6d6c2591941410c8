"""nanospec on Ray (``nanospec.ray``), on a local cluster this module starts: 2 CPUs, every server on
loopback, shut down after the module even when a test fails, each wait bounded. Ray Data with 2 replicas gives
exactly ``LLM.generate``'s tokens (greedy, speculation on, drafts accepted); an actor that dies mid-batch is
restarted and every row comes out once; Ray Serve with 2 replicas answers completions and streamed chat
through the openai client as the offline engine does, both replicas serving. Marked ``ray``; skipped when the
``ray`` extra is not installed. Runs in about a minute (the engines are tiny)."""

import importlib.util
import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from conftest import save_assistant, vocab8_target
from helpers import chat_texts, make_llm
from test_fresh_machine import REPO, user_env
from transformers import AutoConfig

from nanospec import SamplingParams
from nanospec.ray import LLMPredictor

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="needs the ray extra: pip install '.[ray]'"
    ),
]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, page_size=16)
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
RETRIES = dict(max_restarts=2, max_task_retries=2)  # Ray Data's own (unbounded by default), bounded here


def within(seconds: float, fn, *args):
    """``fn(*args)`` in a thread; TimeoutError after ``seconds`` (the cluster is then shut down)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=seconds)


def listening() -> set:
    """(ip, port) of every socket this process and its descendants listen on."""
    addrs = set()
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            addrs |= {c.laddr for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return addrs


def new_ips(before: set) -> set:
    return {ip for ip, _ in listening() - before}


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


RAY_DRIVER = """
import json
import sys

import ray

from nanospec.ray import LLMPredictor

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])
try:
    assert ray.util.get_node_ip_address() == "127.0.0.1", ray.util.get_node_ip_address()
    prompts = json.loads(sys.argv[2])
    options = json.loads(sys.argv[3])
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
    ds = ds.map_batches(LLMPredictor, fn_constructor_kwargs=options, concurrency=1, batch_size=2)
    rows = ds.take_all()
    print(json.dumps({r["id"]: [int(t) for t in r["generated_token_ids"]] for r in rows}))
finally:
    ray.shutdown()
"""


def test_ray_data_driver_in_the_repo_root(smollm2_dir):
    """A Ray Data driver started in the repo root (Ray puts the driver's cwd on every worker's sys.path): an
    ``LLMPredictor`` actor builds the default model and returns ``LLM.generate``'s greedy tokens. Ray runs on
    loopback (single-machine mode), with a random auth token; the driver shuts Ray down, and every process of
    its process group is killed after it, even when the test fails. First in this module: its cluster is gone
    before the module's own starts."""
    prompts = ["The capital of France is", "Once upon a time"]
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    engine = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, page_size=16)
    ray_env = dict(  # as tests/test_ray.py: 0 turns on Ray's single-machine mode, every server on 127.0.0.1
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=os.urandom(16).hex(),
        RAY_USAGE_STATS_ENABLED="0",
    )
    with tempfile.TemporaryDirectory(prefix="ray") as tmp:
        argv = [
            sys.executable,
            "-c",
            RAY_DRIVER,
            tmp,
            json.dumps(prompts),
            json.dumps(engine | {"sampling_params": greedy}),
        ]
        driver = subprocess.Popen(
            argv,
            cwd=REPO,
            env=user_env() | ray_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = driver.communicate(timeout=300)
        finally:
            try:  # what is left of the driver's process group (Ray's processes share its fate anyway)
                os.killpg(driver.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            driver.wait()
    assert driver.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    ref = make_llm(smollm2_dir).generate(prompts, SamplingParams(**greedy), use_tqdm=False)
    assert [got[str(i)] for i in range(2)] == [o["token_ids"] for o in ref]
    assert [len(got[str(i)]) for i in range(2)] == [4, 4]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """``ray`` with a local cluster of 2 CPUs started. Loopback only: Ray's single-machine mode (the node IP
    is 127.0.0.1, so every server binds there); a random auth token in the environment (nothing written to
    ~/.ray); the session files in a temporary dir; the ``nanospec`` folder uploaded (``py_modules``). Shut
    down (every process it started) after the module."""
    env = dict(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_USAGE_STATS_ENABLED="0",
    )
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        import ray

        def loopback_grpc():  # Ray Serve 2.60 binds each replica's inter-deployment gRPC server to [::]:0
            from ray._common import tls_utils

            bind = tls_utils.add_port_to_grpc_server
            tls_utils.add_port_to_grpc_server = lambda server, at: bind(
                server, at.replace("[::]", "127.0.0.1")
            )

        tmp = tmp_path_factory.mktemp("ray")
        import nanospec

        # loopback_grpc runs in every worker, before Serve's modules load; nanospec ships as users ship it
        setup = dict(worker_process_setup_hook=loopback_grpc, py_modules=[nanospec])
        children = set(psutil.Process().children(recursive=True))
        before = listening()
        ray.init(
            num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(tmp), runtime_env=setup
        )
        try:
            assert ray.util.get_node_ip_address() == "127.0.0.1"
            assert new_ips(before) <= LOOPBACK, new_ips(before)
            yield ray
        finally:
            started = set(psutil.Process().children(recursive=True)) - children
            ray.shutdown()
            assert not psutil.wait_procs(started, timeout=30)[1]  # every process Ray started has exited


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory, smollm2_tokenizer):
    """A vocab-8 target and a random assistant (its drafts are often right): (target dir, assistant dir)."""
    tmp = tmp_path_factory.mktemp("ray_spec")
    target = vocab8_target(tmp / "target", smollm2_tokenizer)
    return str(target), str(save_assistant(tmp / "assistant", AutoConfig.from_pretrained(target)))


def test_predictor_in_process(tiny_llama_dir):
    """The callable itself (no cluster): bad options fail before any weights load, naming the field; a
    ``prompt`` batch equals ``LLM.generate``, other columns pass through; a batch needs one input column."""
    for kw, match in [
        (dict(sampling_params=dict(max_tokens=0)), "SamplingParams.max_tokens must be >= 1"),
        (dict(sampling_params=dict(max_token=5)), "sampling_params: .*'max_token'"),
        (dict(sampling_params=[1]), "sampling_params must be a dict or SamplingParams"),
        (dict(dtype="fp8"), "dtype must be one of"),
        (dict(max_num_seq=4), r"unknown LLM option\(s\) \['max_num_seq'\]"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            LLMPredictor(str(tiny_llama_dir), **{"sampling_params": GREEDY, **ENGINE, **kw})
    predictor = LLMPredictor(str(tiny_llama_dir), sampling_params=GREEDY, **ENGINE)
    prompts = ["The capital of France is", "Once upon a time"]
    out = predictor({"prompt": prompts, "id": [7, 8]})
    ref = make_llm(tiny_llama_dir).generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    assert out["id"] == [7, 8] and out["generated_token_ids"] == [o["token_ids"] for o in ref]
    assert out["generated_text"] == [o["text"] for o in ref] and out["num_generated_tokens"] == [12, 12]
    assert out["finish_reason"] == ["length"] * 2 and "accept_lengths" not in out
    with pytest.raises(ValueError, match="exactly one of the columns"):
        predictor({"prompt": prompts, "prompt_token_ids": [[1], [2]]})


def test_data_two_replicas_equal_generate(ray_cluster, spec_model):
    """16 token-id prompts through 2 actors (4 batches) with speculation on: the tokens of LLM.generate."""
    target, assistant = spec_model
    prompts = [[1 + i % 7, 1 + i % 5, 3, 1 + i % 3][: 2 + i % 3] for i in range(16)]
    options = dict(model=target, assistant=assistant, num_steps=2, sampling_params=GREEDY, **ENGINE)
    ds = ray_cluster.data.from_items([{"id": i, "prompt_token_ids": p} for i, p in enumerate(prompts)])
    ds = ds.map_batches(LLMPredictor, fn_constructor_kwargs=options, concurrency=2, batch_size=4)
    rows = within(300, ds.take_all)
    ref = make_llm(target, assistant, num_steps=2).generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    assert sorted(r["id"] for r in rows) == list(range(16))
    got = {r["id"]: list(r["generated_token_ids"]) for r in rows}
    assert [got[i] for i in range(16)] == [o["token_ids"] for o in ref]
    assert all(list(r["prompt_token_ids"]) == prompts[r["id"]] for r in rows)  # passed through
    assert sum(a > 1 for r in rows for a in r["accept_lengths"]) > 0  # drafts were accepted


def test_data_actor_dies_mid_batch(ray_cluster, tiny_llama_dir, smollm2_tokenizer, tmp_path):
    """The actor processing row 5 dies once, after generating and before returning (a marker file makes it
    die only once): Ray restarts it (max_restarts), retries the batch on it (max_task_retries), and every one
    of the 16 chat rows comes out exactly once with LLM.generate's tokens."""
    died = tmp_path / "died"

    class DiesOnce(LLMPredictor):
        def __call__(self, batch):
            out = super().__call__(batch)
            if 5 in list(batch["id"]) and not died.exists():
                died.write_text(str(os.getpid()))
                os._exit(1)
            return out

    questions = [f"What is {i} plus {i}?" for i in range(16)]
    items = [{"id": i, "messages": [{"role": "user", "content": q}]} for i, q in enumerate(questions)]
    options = dict(model=str(tiny_llama_dir), sampling_params=GREEDY, **ENGINE)
    ds = ray_cluster.data.from_items(items)
    ds = ds.map_batches(DiesOnce, fn_constructor_kwargs=options, concurrency=2, batch_size=4, **RETRIES)
    rows = within(300, ds.take_all)
    assert died.exists()
    ref = make_llm(tiny_llama_dir).generate(
        chat_texts(smollm2_tokenizer, questions), SamplingParams(**GREEDY), use_tqdm=False
    )
    assert sorted(r["id"] for r in rows) == list(range(16))
    got = {r["id"]: (list(r["generated_token_ids"]), r["generated_text"]) for r in rows}
    assert [got[i] for i in range(16)] == [(o["token_ids"], o["text"]) for o in ref]


def test_build_app_checks_its_arguments(ray_cluster, tiny_llama_dir):
    """``serve run``'s strings take their option's type; a bad value is named before any replica starts."""
    from ray.serve import Application

    from nanospec.ray import build_app

    model = str(tiny_llama_dir)
    for args, match in [
        (dict(num_replicas="0"), "num_replicas must be an int >= 1, got 0"),
        (dict(num_replicas="two"), "num_replicas must be an int, got 'two'"),
        (dict(max_num_seqs="4.5"), "max_num_seqs must be an int, got '4.5'"),
        (dict(enforce_eager="yes"), "enforce_eager must be true or false, got 'yes'"),
        (dict(dtype="fp8"), "dtype must be one of"),
        (dict(max_num_seq="4"), r"unknown LLM option\(s\) \['max_num_seq'\]"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            build_app(dict(model=model, device="cpu") | args)
    args = dict(
        model=model, num_replicas="2", max_num_seqs="4", enforce_eager="true", overlap_schedule="none"
    )
    assert isinstance(build_app(args | dict(device="cpu", gpu_memory_utilization="0.5")), Application)


def test_py_modules_ship_the_kernels(ray_cluster):
    """``ray.init(runtime_env={"py_modules": [nanospec]})`` (the ``ray_cluster`` fixture) uploads the
    ``nanospec`` folder; the kernels travel with it (``nanospec/kernels`` is a link to ``kernels/``, which the
    upload follows)."""

    def nanospec_from_py_modules(repo: str):
        """In the worker, with neither the repo nor the editable install on the path (only the uploaded
        folder can provide it), import ``nanospec.kernels.matmul``; where it came from."""
        import pathlib
        import sys

        sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != pathlib.Path(repo)]
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        for name in [m for m in sys.modules if m == "nanospec" or m.startswith("nanospec.")]:
            del sys.modules[name]
        import nanospec.kernels.matmul

        return nanospec.__file__, nanospec.kernels.matmul.__file__

    task = ray_cluster.remote(nanospec_from_py_modules)
    package, matmul = within(300, ray_cluster.get, task.remote(str(REPO)))
    assert not pathlib.Path(package).resolve().is_relative_to(REPO), package
    assert pathlib.Path(matmul).parent.parent == pathlib.Path(package).parent
    assert pathlib.Path(matmul).parts[-3:] == ("nanospec", "kernels", "matmul.py")


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_llama_dir):
    """``build_app`` with 2 replicas of the tiny Llama on Serve, its HTTP proxy on a free loopback port:
    (base URL, model name). Serve is shut down after the module's Serve tests, even when one fails."""
    import socket

    from ray import serve

    from nanospec.ray import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = listening()
    serve.start(http_options=dict(host="127.0.0.1", port=port))
    try:
        app = build_app(dict(model=str(tiny_llama_dir), num_replicas=2, **ENGINE))
        within(300, lambda: serve.run(app, name="nanospec", route_prefix="/"))
        assert new_ips(before) <= LOOPBACK, new_ips(before)  # the proxy and both replicas among them
        yield f"http://127.0.0.1:{port}", str(tiny_llama_dir)
    finally:
        serve.shutdown()


def test_serve_two_replicas_equal_offline(served, tiny_llama_dir, smollm2_tokenizer):
    """Completions and streamed chat through the openai client equal offline greedy (same text, same token
    count), 8 of each at once; the replica header shows that both replicas answered."""
    import openai

    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompts = [f"Count to {i}:" for i in range(8)]
    questions = [f"What is {i} times {i}?" for i in range(8)]
    extra = dict(extra_body={"ignore_eos": True}, max_tokens=12, temperature=0, model=model)

    def complete(prompt):
        raw = client.completions.with_raw_response.create(prompt=prompt, **extra)
        out = raw.parse()
        return raw.headers["x-nanospec-replica"], out.choices[0].text, out.usage.completion_tokens

    def chat(question):
        messages = [{"role": "user", "content": question}]
        raw = client.chat.completions.with_raw_response.create(messages=messages, stream=True, **extra)
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        return raw.headers["x-nanospec-replica"], text

    with ThreadPoolExecutor(16) as pool:
        completions = list(pool.map(complete, prompts))
        chats = list(pool.map(chat, questions))
    llm = make_llm(tiny_llama_dir)
    ref = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    assert [c[1:] for c in completions] == [(o["text"], 12) for o in ref]
    ref = llm.generate(chat_texts(smollm2_tokenizer, questions), SamplingParams(**GREEDY), use_tqdm=False)
    assert [c[1] for c in chats] == [o["text"] for o in ref]
    assert len({c[0] for c in completions + chats}) == 2  # both replicas answered
