"""`kvjax serve` as clients meet it: a live server (the real command, in a process of its own) on a free
loopback port, the official `openai` client and lm-evaluation-harness against it, its answers held to
what kvjax computes directly (`Generator`, `Generator.score`), every error in OpenAI's shape, 64 streams
at once with a quarter of their clients leaving midway, and a shutdown that ends streams cleanly."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from kvjax import DecodingConfig, Generator  # noqa: E402
from kvjax.compress import parse_policy  # noqa: E402
from kvjax.training.loading import load_model  # noqa: E402

CHAT = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
NAME = "tiny"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Live:
    """`kvjax serve RUN ...` in a process of its own, waited for until /health answers 200."""

    def __init__(self, run: str, tmp, *extra: str):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        template = tmp / "chat.jinja"
        template.write_text(CHAT)
        argv = [sys.executable, "-m", "kvjax.commands", "serve", run, "--port", str(self.port), "--slots", "8"]
        argv += ["--max-tokens", "256", "--allow-long-context", "--served-model-name", NAME]
        argv += ["--chat-template", str(template), "--grace", "2", "--no-warm", *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline, self.loading, self.early = time.monotonic() + 300, set(), None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                status, _ = _get(f"{self.url}/health")
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
                continue
            if status == 200:
                break
            self.loading.add(status)
            if self.early is None:  # a completion asked for while the weights load
                self.early = _post(f"{self.url}/v1/completions", {"prompt": "x"})
            time.sleep(0.2)

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def stop(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        out, _ = self.proc.communicate(timeout=120)
        return self.proc.returncode, out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from kvjax.commands import main
    from tests.training.test_cli import TINY

    path = str(tmp_path_factory.mktemp("serve") / "run")
    assert main(["train", "gqa", *TINY, "--run-dir", path]) == 0
    return path


@pytest.fixture(scope="module")
def live(run, tmp_path_factory):
    server = Live(run, tmp_path_factory.mktemp("live"))
    yield server
    if server.proc.poll() is None:
        server.stop()


@pytest.fixture(scope="module")
def loaded(run):
    return load_model(run)


def greedy(loaded, prompt: list[int], n: int, policy=None) -> list[int]:
    """What Generator alone generates greedily (stopping after the end token, which is not text)."""
    gen = Generator(loaded.model, capacity=256, policy=None if policy is None else parse_policy(policy))
    out = gen([prompt], DecodingConfig(max_new_tokens=n, eos_id=loaded.tokenizer.eos_id))
    ids = np.asarray(out.tokens[0, : out.lengths[0]]).tolist()
    return ids[:-1] if ids and ids[-1] == loaded.tokenizer.eos_id else ids


def text_prompt(loaded, text: str) -> list[int]:
    return [loaded.tokenizer.bos_id, *loaded.tokenizer.encode(text)]  # runs trained here start with BOS


def test_the_openai_client_gets_the_engines_greedy_tokens(live, loaded):
    """Completions and chat, whole and streamed, and a prompt of token ids: the text Generator's greedy
    tokens make; a request's own kv_policy gives what Generator with that policy gives; /health answered
    503 while the model loaded."""
    client, tok = live.client(), loaded.tokenizer
    assert live.loading == {503}  # while the weights loaded
    status, answer = live.early
    assert status == 503 and "the model is loading; try again later" in answer["error"]["message"]
    prompt = "import json\nfrom os import "
    want = tok.decode(greedy(loaded, text_prompt(loaded, prompt), 12))
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == want and whole.usage.completion_tokens <= 12
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    ids = text_prompt(loaded, "def main(")
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == tok.decode(greedy(loaded, ids, 6))
    policy = client.completions.create(
        model=NAME, prompt=prompt * 3, max_tokens=6, temperature=0, extra_body={"kv_policy": "streaming:0.5"}
    )
    assert policy.choices[0].text == tok.decode(greedy(loaded, text_prompt(loaded, prompt * 3), 6, "streaming:0.5"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "print("}]
    chat_prompt = tok.encode("<system>Be brief.\n<user>print(\n<assistant>")  # the test's template
    want = tok.decode(greedy(loaded, chat_prompt, 10))
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_echo_logprobs_equal_generator_score_and_stop_strings_end_the_text(live, loaded):
    """lm-eval's loglikelihood request (max_tokens 1, echo, logprobs 1): every prompt token's
    log-probability after the first, equal to Generator.score on the same tokens, with the likeliest token
    at each place; a stop string ends the text before it."""
    client, tok = live.client(), loaded.tokenizer
    ids = text_prompt(loaded, "import os\nimport sys\n")
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    want, full = Generator(loaded.model, capacity=64).score([ids[:1]], [ids[1:]], keep_logits=True)
    np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], want[0], atol=2e-5)
    for i, top in enumerate(lp.top_logprobs[1 : len(ids)]):
        (value,) = top.values()
        assert value == pytest.approx(float(full[0, i].max()), abs=2e-5)
    text = tok.decode(greedy(loaded, text_prompt(loaded, "import "), 20))
    stop = text[5:7]
    assert len(stop) == 2
    cut = client.completions.create(model=NAME, prompt="import ", max_tokens=20, temperature=0, stop=[stop, "@@@"])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_a_seeded_request_repeats_and_ignore_eos_generates_through_the_end_token(live):
    """The same seeded request samples the same tokens each time it is sent. One that the end token ends
    early ("stop") runs on to max_tokens under `ignore_eos`, its first tokens the same (the seed is
    searched for: the tiny model samples its end token about once in a few hundred tokens at this heat)."""
    body = {"prompt": "import ", "max_tokens": 40, "temperature": 2.0, "logprobs": 0}
    for seed in range(100):
        status, stopped = _post(f"{live.url}/v1/completions", {**body, "seed": seed})
        assert status == 200
        if stopped["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no seed in 100 sampled the end token")
    assert _post(f"{live.url}/v1/completions", {**body, "seed": seed})[1]["choices"] == stopped["choices"]
    status, through = _post(f"{live.url}/v1/completions", {**body, "seed": seed, "ignore_eos": True})
    assert through["choices"][0]["finish_reason"] == "length" and through["usage"]["completion_tokens"] == 40
    n = stopped["usage"]["completion_tokens"]
    assert n < 40 and through["choices"][0]["logprobs"]["tokens"][:n] == stopped["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model 'gpt-4' does not exist"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n=2 is not supported"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens=-1 must be an integer >= 0"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature='hot' must be a number"),
        ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt={'a': 1} must be a string"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs=99 must be an integer in [0, 20]"),
        ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos='yes' must be true or false"),
        ("/v1/completions", {"prompt": "x" * 300}, 400, "a request holds at most 256"),
        ("/v1/completions", {"prompt": "x", "kv_policy": "snapkv:0.5"}, 400, "needs positions per head"),
        ("/v1/completions", {"prompt": "x", "kv_policy": "warp:9"}, 400, "method='warp' must be one of"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages=[] must be a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "must have a role"),
    ],
)
def test_errors_come_in_openais_shape_before_any_compute(live, path, body, status, message):
    got, answer = _post(f"{live.url}{path}", body)
    assert got == status and message in answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}


def test_tokenizer_endpoints_and_metrics(live, loaded):
    tok = loaded.tokenizer
    status, body = _post(f"{live.url}/tokenize", {"prompt": "héllo", "add_special_tokens": False})
    assert status == 200 and body["tokens"] == tok.encode("héllo")
    assert _post(f"{live.url}/detokenize", {"tokens": tok.encode("héllo")})[1]["prompt"] == "héllo"
    info = json.loads(_get(f"{live.url}/tokenizer_info")[1])
    assert info["chat_template"] == CHAT and info["model_max_length"] == 256
    models = json.loads(_get(f"{live.url}/v1/models")[1])
    assert models["data"][0]["id"] == NAME
    metrics = _get(f"{live.url}/metrics")[1].decode()
    names = ("kvjax_requests_running", "kvjax_pages_free", "kvjax_kv_bytes_per_slot", "kvjax_kv_bytes_per_token")
    for name in (*names, "kvjax_preemptions_total", "kvjax_generation_tokens_per_second"):
        assert name in metrics
    assert "kvjax_time_to_first_token_seconds_count" in metrics and "kvjax_generation_tokens_total" in metrics


def test_sixty_four_streams_with_sixteen_clients_leaving(live, loaded):
    """64 concurrent streaming requests, 16 of whose clients close their stream after a few chunks: every
    finished one equals Generator alone, the pool is empty afterwards, and /health answered throughout."""
    tok, rng = loaded.tokenizer, np.random.default_rng(0)
    lines = ["import os", "def f(x):", "class A:", "return x", "for i in range(3):", "print('hi')"]
    prompts = [" ".join(rng.choice(lines, 2)) for _ in range(64)]
    news = [int(n) for n in rng.integers(4, 24, 64)]
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
    health: list[int] = []

    async def one(i):
        stream = await client.completions.create(
            model=NAME, prompt=prompts[i], max_tokens=news[i], temperature=0, stream=True
        )
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text
            if i % 4 == 0 and len(text) >= 2:
                await stream.close()
                return None
        return text

    async def watch(done):
        while not done.is_set():
            health.append(await asyncio.to_thread(lambda: _get(f"{live.url}/health")[0]))
            await asyncio.sleep(0.2)

    async def everything():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        texts = await asyncio.gather(*(one(i) for i in range(64)))
        done.set()
        await watcher
        return texts

    texts = asyncio.run(everything())
    for i, text in enumerate(texts):
        if i % 4:
            assert text == tok.decode(greedy(loaded, text_prompt(loaded, prompts[i]), news[i])), i
    assert health and set(health) == {200}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = _get(f"{live.url}/metrics")[1].decode()
        used = float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("kvjax_pages_used ")))
        if used == 0:
            break
        time.sleep(0.2)
    assert used == 0


def test_a_full_queue_says_429_and_a_shutdown_ends_streams_with_a_last_chunk_and_exits_0(run, tmp_path):
    """One slot and room for one waiting request: a third request while one runs and one waits is a 429.
    Then SIGINT: the stream in flight (`ignore_eos`, so it cannot end first) gets its last chunk
    (finish_reason abort after the grace period) and [DONE], and the process exits 0."""
    import threading

    server = Live(run, tmp_path, "--slots", "1", "--max-waiting", "1", "--max-tokens", "4096")
    running = {"prompt": "import ", "max_tokens": 4000, "temperature": 0.7, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(  # seconds of tokens: it runs on while the others arrive, until SIGINT
        f"{server.url}/v1/completions", json.dumps(running).encode(), {"Content-Type": "application/json"}
    )
    response = urllib.request.urlopen(request, timeout=60)
    first = response.readline()
    assert first.startswith(b"data: ")
    body = {"prompt": "def ", "max_tokens": 200, "temperature": 0.7}
    waiting = threading.Thread(target=_post, args=(f"{server.url}/v1/completions", body))
    waiting.start()
    deadline = time.monotonic() + 60
    while "kvjax_requests_waiting 1.0" not in _get(f"{server.url}/metrics")[1].decode():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, answer = _post(f"{server.url}/v1/completions", body)
    assert status == 429 and "1 request waiting (at most 1)" in answer["error"]["message"]
    server.proc.send_signal(signal.SIGINT)
    rest = response.read().decode()
    code, _ = server.proc.communicate(timeout=120)
    assert rest.rstrip().endswith("data: [DONE]")
    last = json.loads([line for line in rest.splitlines() if line.startswith("data: {")][-1][6:])
    assert last["choices"][0]["finish_reason"] == "abort"
    waiting.join(timeout=60)
    assert server.proc.returncode == 0


def _loglikelihood(loaded, context: str, continuation: str) -> float:
    """What lm-eval sums for a choice: the continuation's tokens after the context's (no BOS: as sent)."""
    tok = loaded.tokenizer
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    logp, _ = Generator(loaded.model, capacity=128).score([whole[: len(ctx)]], [whole[len(ctx) :]])
    return float(logp.sum())


@pytest.mark.slow
def test_lm_evaluation_harness_scores_what_kvjax_computes(live, loaded, tmp_path):
    """lm-evaluation-harness's `local-completions` model (remote tokenizer) on two offline tasks over local
    JSONL files: a multiple-choice (loglikelihood) task and a generate_until task, whose answers are set so
    half the items are right; its accuracies equal what kvjax computes directly on the same items, also
    with `kv_policy` passed through the generation arguments."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    tok = loaded.tokenizer
    contexts = ["import os\nimport", "def f(x):\n   ", "class A:\n   ", "for i in", "print(", "return"]
    choices = [" sys", " json", " re"]
    items, want_mc = [], []
    for i, context in enumerate(contexts):
        best = int(np.argmax([_loglikelihood(loaded, context, c) for c in choices]))
        answer = best if i % 2 == 0 else (best + 1) % 3
        items.append({"question": context, "choices": choices, "answer": answer})
        want_mc.append(answer == best)

    def generated(context, policy=None):
        text = tok.decode(greedy(loaded, tok.encode(context), 8, policy))
        return text.split("\n")[0]

    gens = [{"prompt": c, "target": generated(c) if i % 2 == 0 else "no such text"} for i, c in enumerate(contexts)]
    for name, rows in (("mc", items), ("gen", gens)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mc.yaml").write_text(
        f"task: kvjax_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path}/mc.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    (tmp_path / "gen.yaml").write_text(
        f"task: kvjax_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path}/gen.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "target_delimiter: ''\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n"
    )
    args = f"base_url={live.url}/v1/completions,model={NAME},tokenizer_backend=remote,tokenized_requests=True"

    def evaluate(**extra):
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=["kvjax_mc", "kvjax_gen"],
            task_manager=TaskManager(include_path=str(tmp_path)),
            batch_size=1,
            log_samples=False,
            bootstrap_iters=0,
            **extra,
        )
        return out["results"]

    results = evaluate()
    assert results["kvjax_mc"]["acc,none"] == pytest.approx(np.mean(want_mc)) == pytest.approx(0.5)
    assert results["kvjax_gen"]["exact_match,none"] == pytest.approx(0.5)
    policy = "streaming:0.5"
    gens = [
        {"prompt": c, "target": generated(c, policy) if i % 3 == 0 else "no such text"} for i, c in enumerate(contexts)
    ]
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gens))
    compressed = evaluate(gen_kwargs={"kv_policy": policy})
    assert compressed["kvjax_gen"]["exact_match,none"] == pytest.approx(2 / 6)


def test_a_failed_step_ends_the_requests_in_flight_and_the_worker_goes_on(make_model, capsys):
    """A step the device fails (memory, a bug) ends the requests it was serving ("cancelled", pages
    freed) instead of killing the engine's thread: the next request is served."""
    from kvjax.engine import Engine, Request
    from kvjax.serve.worker import Listener, Worker

    engine = Engine(make_model("gqa", "model.n_layers=1")[1], n_pages=16, page_size=4, slots=2)
    step, calls = engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: the device ran out of memory")
        return step()

    engine.step = failing
    worker = Worker(engine)

    async def serve(prompt):
        events = asyncio.Queue()
        await worker.submit(
            Request(prompt, DecodingConfig(max_new_tokens=3)), Listener(asyncio.get_running_loop(), events)
        )
        while True:
            _, event = await events.get()
            if event.finish is not None:
                return event.finish

    try:
        assert asyncio.run(serve((1, 2, 3))) == "cancelled"
        assert asyncio.run(serve((4, 5, 6))) == "length" and engine.pool.used_pages == 0
    finally:
        worker.stop()
    assert "RESOURCE_EXHAUSTED" in capsys.readouterr().err
