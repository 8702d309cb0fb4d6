"""`mseq serve`: the official `openai` client gets `mseq generate`'s completions, streamed or not;
concurrent requests share decoding batches; bad requests get one-line 4xx answers and the server
goes on; the real command and a 2-rank deepspeed launch serve the same completions."""

import contextlib
import json
import socket
import sys
import threading
import time

import openai
import pytest
from typer.testing import CliRunner

from launch import env, free_port, shm_leftovers
from metaseq_ds.cli.main import app
from metaseq_ds.serving.protocol import FINISH_REASONS
from metaseq_ds.serving.runner import ModelRunner
from serving import API_KEY, bearer, interrupt, request, server_thread, start_process, write_checkpoint

PROMPTS = ["the model", "loss of the data", "weights", "a batch"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt")


@pytest.fixture(scope="module")
def interface(checkpoint):
    from metaseq_ds.hub_utils import GeneratorInterface

    interface = GeneratorInterface(str(checkpoint))
    interface.load_model()
    return interface


@pytest.fixture(scope="module")
def server(interface):
    with server_thread(interface) as running:
        yield running


def _client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _generate(checkpoint, prompts, fields):
    """`mseq generate`'s jsonl records for the request `fields` (OpenAI names), in choice order."""
    args = ["generate", "--path", str(checkpoint), *prompts, "--output-format", "jsonl"]
    for field, value in fields.items():
        flag = "--" + field.replace("_", "-")
        if value is True:
            args.append(flag)
        else:
            for item in value if isinstance(value, list) else [value]:
                args += [flag, str(item)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def _complete(url, prompts, fields, stream: bool):
    """The choices (dicts, by index) of one request through the openai client, a stream joined."""
    extensions = {k: fields[k] for k in ("top_k", "min_tokens", "length_penalty") if k in fields}
    standard = {k: v for k, v in fields.items() if k not in extensions}
    response = _client(url).completions.create(model="tiny", prompt=prompts if len(prompts) > 1 else prompts[0],
                                               stream=stream, extra_body=extensions or None, **standard)
    if not stream:
        return [choice.model_dump() for choice in sorted(response.choices, key=lambda c: c.index)], None
    joined, pieces = {}, {}
    for chunk in response:
        [piece] = chunk.choices
        choice = joined.setdefault(piece.index, {"text": "", "index": piece.index, "logprobs": None,
                                                 "finish_reason": None})
        assert choice["finish_reason"] is None, "a chunk came after the choice's last one"
        choice["text"] += piece.text
        choice["finish_reason"] = piece.finish_reason
        if piece.logprobs is not None:
            logprobs = choice["logprobs"] or {key: [] for key in piece.logprobs.model_dump()}
            for key, values in piece.logprobs.model_dump().items():
                logprobs[key] += values
            choice["logprobs"] = logprobs
        pieces[piece.index] = pieces.get(piece.index, 0) + 1
    return [joined[index] for index in sorted(joined)], pieces


def _assert_same(choices, records, logprobs: bool):
    assert len(choices) == len(records)
    for choice, record in zip(choices, records):
        assert choice["text"] == record["text"]
        assert choice["finish_reason"] == FINISH_REASONS[record["finish_reason"]]
        if not logprobs:
            assert choice["logprobs"] is None
            continue
        got = choice["logprobs"]
        assert got["tokens"] == record["tokens"] and got["text_offset"] == record["text_offset"]
        assert [s is None for s in got["token_logprobs"]] == [s is None for s in record["token_scores"]]
        assert [s for s in got["token_logprobs"] if s is not None] == \
            pytest.approx([s for s in record["token_scores"] if s is not None], abs=1e-5)
        assert len(got["top_logprobs"]) == len(record["top_logprobs"])
        for mine, theirs in zip(got["top_logprobs"], record["top_logprobs"]):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert mine == pytest.approx(theirs, abs=1e-5)


CASES = {
    "greedy": (PROMPTS[:1], dict(temperature=0, max_tokens=12)),
    "seeded_sampling": (PROMPTS[:2], dict(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=12)),
    "beam": (PROMPTS[:1], dict(temperature=0, best_of=3, n=2, max_tokens=8, length_penalty=0.5)),
    "best_of_samples": (PROMPTS[:1], dict(temperature=1.0, best_of=3, n=2, seed=5, max_tokens=8)),
    "logprobs": (PROMPTS[:2], dict(temperature=0, max_tokens=8, logprobs=3, min_tokens=4)),
    "echo": (PROMPTS[:1], dict(temperature=0, max_tokens=6, echo=True, logprobs=1)),
    "four_prompts": (PROMPTS, dict(temperature=0, max_tokens=10)),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_openai_client_gets_mseq_generates_completions(checkpoint, server, case, stream):
    prompts, fields = CASES[case]
    choices, pieces = _complete(server.url, prompts, fields, stream)
    _assert_same(choices, _generate(checkpoint, prompts, fields), "logprobs" in fields)
    if stream and case in ("greedy", "four_prompts"):  # tokens are sent as they are chosen
        assert all(count > 1 for count in pieces.values()), pieces


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_multi_token_stop_string_ends_the_completion_before_it(checkpoint, server, stream):
    # Two byte tokens first seen past the start of a prompt's free completion (which prompt has
    # one depends on the random weights).
    for prompt in PROMPTS:
        free_text = _generate(checkpoint, [prompt], dict(temperature=0, max_tokens=20))[0]["text"]
        starts = [i for i in range(3, len(free_text) - 2)
                  if free_text.find(free_text[i:i + 2]) == i and free_text[i:i + 2].isascii()]
        if starts:
            break
    else:
        raise AssertionError("no prompt's free completion has a two-token stop string to test")
    start = starts[0]
    stop = free_text[start:start + 2]
    fields = dict(temperature=0, max_tokens=20, stop=[stop, "never seen"])
    choices, _ = _complete(server.url, [prompt], fields, stream)
    _assert_same(choices, _generate(checkpoint, [prompt], fields), logprobs=False)
    assert choices[0]["finish_reason"] == "stop" and choices[0]["text"] == free_text[:start]


class GatedRunner(ModelRunner):
    """Holds the first batch until `gate` opens; records the size of every batch."""

    def __init__(self, interface):
        super().__init__(interface, ranks=1)
        self.batches = []
        self.gate = threading.Event()

    def __call__(self, jobs):
        if jobs:
            self.batches.append(len(jobs))
            if len(self.batches) == 1:
                assert self.gate.wait(120)
        super().__call__(jobs)


def test_requests_waiting_during_a_batch_decode_together_each_to_its_own_length(interface):
    runner = GatedRunner(interface)
    requests = [(PROMPTS[i % 4], dict(temperature=0, max_tokens=limit)) for i, limit in enumerate([3, 12, 7, 9, 5])]
    requests.append((PROMPTS[0], dict(temperature=0, max_tokens=6, logprobs=2)))  # other options: a batch of its own
    with server_thread(interface, runner=runner, batching="static") as running:
        results = [None] * (len(requests) + 1)

        def send(slot, prompt, fields):
            results[slot] = _client(running.url).completions.create(model="tiny", prompt=prompt, **fields)

        threads = [threading.Thread(target=send, args=(0, PROMPTS[1], dict(temperature=0, max_tokens=4)))]
        threads[0].start()
        deadline = time.monotonic() + 60
        while not runner.batches:  # the first request is being decoded: the others will wait
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for slot, (prompt, fields) in enumerate(requests, start=1):
            threads.append(threading.Thread(target=send, args=(slot, prompt, fields)))
            threads[-1].start()
        while len(running.batcher.waiting) < len(requests):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        runner.gate.set()
        for thread in threads:
            thread.join(timeout=120)
        assert runner.batches[0] == 1 and sorted(runner.batches[1:]) == [1, 5]  # in the order they arrived
        for (prompt, fields), batched in zip(requests, results[1:]):
            alone = _client(running.url).completions.create(model="tiny", prompt=prompt, **fields)
            assert [c.model_dump() for c in batched.choices] == [c.model_dump() for c in alone.choices]
            assert batched.usage.completion_tokens <= fields["max_tokens"]
        assert runner.batches[3:] == [1] * len(requests)


def _one_line_error(status, body, expected_status, *needles, param=None):
    assert status == expected_status, body
    message = body["error"]["message"]
    assert "\n" not in message and "Traceback" not in message
    for needle in needles:
        assert needle in message
    assert body["error"]["param"] == param


BAD_REQUESTS = {
    "malformed_json": (b'{"prompt": "x", "max_tokens": 3', 400, ["not valid JSON"], None),
    "not_an_object": ([1, 2], 400, ["must be a JSON object"], None),
    "unknown_field": ({"prompt": "x", "max_tokenz": 3}, 400, ["unknown field 'max_tokenz'"], "max_tokenz"),
    "unsupported_openai_field": ({"prompt": "x", "presence_penalty": 1}, 400, ["not supported"], "presence_penalty"),
    "max_tokens_0": ({"prompt": "x", "max_tokens": 0}, 400, ["max_tokens must be >= 1, got 0"], "max_tokens"),
    "max_tokens_huge": ({"prompt": "x", "max_tokens": 10**9}, 400, ["max_tokens must be <= 63"], "max_tokens"),
    "prompt_longer_than_the_model": ({"prompt": "word " * 20}, 400, ["prompt 1 has 101 tokens", "64 positions"],
                                     "prompt"),
    "prompt_of_a_wrong_type": ({"prompt": {"text": "x"}}, 400, ["prompt must be a string"], "prompt"),
    "token_outside_the_vocabulary": ({"prompt": [5, 99999]}, 400, ["token id 99999"], "prompt"),
    "no_prompt": ({"max_tokens": 3}, 400, ["prompt is required"], "prompt"),
    "n_over_best_of": ({"prompt": "x", "n": 3, "best_of": 2}, 400, ["need n <= best_of"], "n"),
    "over_the_batch_budget": ({"prompt": ["x"] * 40, "best_of": 8, "max_tokens": 60}, 400,
                              ["320 sequences", "at most 64 at once", "--max-batch-tokens 4096"], "prompt"),
    "too_many_logprobs": ({"prompt": "x", "logprobs": 50}, 400, ["logprobs must be <= 20"], "logprobs"),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_a_bad_request_is_a_one_line_4xx_and_the_server_goes_on(server, name):
    body, status, needles, param = BAD_REQUESTS[name]
    _one_line_error(*request(server.url, "POST", "/v1/completions", body, bearer()), status, *needles, param=param)
    ok, answer = request(server.url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, bearer())
    assert ok == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(server):
    body = json.dumps({"prompt": "x" * 70000}).encode()
    _one_line_error(*request(server.url, "POST", "/completions", body, bearer()), 413, "--max-request-bytes")


def test_every_route_but_health_needs_the_key(server):
    assert request(server.url, "GET", "/health") == (200, {"status": "ok"})
    for method, path in [("GET", "/v1/models"), ("POST", "/completions"), ("POST", "/v1/completions"),
                         ("POST", "/v1/engines/tiny/completions")]:
        body = {"prompt": "x", "max_tokens": 2} if method == "POST" else None
        _one_line_error(*request(server.url, method, path, body), 401, "no API key")
        _one_line_error(*request(server.url, method, path, body, bearer("wrong")), 401, "wrong API key")
        status, answer = request(server.url, method, path, body, bearer())
        assert status == 200, answer
    with pytest.raises(openai.AuthenticationError, match="wrong API key"):
        _client(server.url, key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert [m.id for m in _client(server.url).models.list()] == ["tiny"]


def test_metaseqs_engine_route_and_unknown_routes(server):
    status, answer = request(server.url, "POST", "/v1/engines/anything/completions", {"prompt": [2, 40, 41]}, bearer())
    assert status == 200 and answer["object"] == "text_completion" and answer["usage"]["prompt_tokens"] == 3
    _one_line_error(*request(server.url, "GET", "/v2/nothing", None, bearer()), 404, "Not Found")
    _one_line_error(*request(server.url, "GET", "/v1/completions", None, bearer()), 405, "Method Not Allowed")


def _serve_command(checkpoint, *extra):
    return [sys.executable, "-m", "metaseq_ds.cli.main", "serve", "--path", str(checkpoint), "--port", "0", *extra]


def test_mseq_serve_runs_as_a_command_and_stops_on_ctrl_c(checkpoint, server):
    process, url = start_process(_serve_command(checkpoint, "--api-key", "s3cret"), env(), timeout=120)
    try:
        assert url.startswith("http://127.0.0.1:")
        assert request(url, "GET", "/health")[0] == 200
        assert request(url, "GET", "/v1/models")[0] == 401
        mine = _client(url, key="s3cret").completions.create(model="ckpt", prompt=PROMPTS[:2], max_tokens=6,
                                                              temperature=0)
        assert mine.model == "ckpt"
        reference = _client(server.url).completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6,
                                                            temperature=0)
        assert [c.text for c in mine.choices] == [c.text for c in reference.choices]
    finally:
        assert interrupt(process) == 0, process.stderr.read()[-3000:]


def test_bad_serve_flags_are_one_line_and_exit_2(tmp_path, checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        runs = {
            "port in use": (["--path", str(checkpoint), "--port", port], "cannot listen there"),
            "port out of range": (["--path", str(checkpoint), "--port", "70000"], "65535"),  # typer's message
            "not a checkpoint": (["--path", str(tmp_path / "nope"), "--port", "0"], "is not a checkpoint"),
            "empty key": (["--path", str(checkpoint), "--port", "0", "--api-key", ""], "--api-key is empty"),
        }
        for name, (args, complaint) in runs.items():
            result = CliRunner().invoke(app, ["serve", *args])
            assert result.exit_code == 2, (name, result.output)
            assert complaint in result.output and "Traceback" not in result.output, name


@pytest.mark.slow
def test_under_the_deepspeed_launcher_2_ranks_serve_the_same_completions(checkpoint, server):
    port = free_port()
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               "--module", "metaseq_ds.cli.serve", "--path", str(checkpoint), "--port", "0"]
    process, url = start_process(command, env(), timeout=300)
    try:
        for case in ("four_prompts", "seeded_sampling", "beam"):
            prompts, fields = CASES[case]
            sharded, _ = _complete(url, prompts, {**fields, "logprobs": 2}, stream=False)
            single, _ = _complete(server.url, prompts, {**fields, "logprobs": 2}, stream=False)
            for mine, reference in zip(sharded, single):
                assert (mine["text"], mine["finish_reason"]) == (reference["text"], reference["finish_reason"])
                assert mine["logprobs"]["token_logprobs"] == \
                    pytest.approx(reference["logprobs"]["token_logprobs"], abs=1e-5)
        streamed, _ = _complete(url, PROMPTS[:1], CASES["greedy"][1], stream=True)
        assert streamed == _complete(server.url, PROMPTS[:1], CASES["greedy"][1], stream=False)[0]
    finally:
        interrupt(process)
        stderr = process.stderr.read()
    assert "rank 1: rank 0 stopped serving; stopping" in stderr, stderr[-3000:]  # not killed
    assert not shm_leftovers(port)  # each rank unlinked DeepSpeed's all-reduce buffer


def test_tokenizer_routes_answer_in_vllms_shapes_and_lm_evals_remote_tokenizer_reads_them(server):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    status, info = request(server.url, "GET", "/tokenizer_info", None, bearer())
    assert status == 200, info
    assert (info["bos_token"], info["eos_token"], info["pad_token"], info["unk_token"]) == ("</s>", "</s>", "<pad>",
                                                                                          "<unk>")
    assert info["model_max_length"] == 64
    text = "hé</s>x"  # one byte token per UTF-8 byte (id 4 + byte); the special token's text is its id
    ids = [4 + ord("h"), 4 + 0xC3, 4 + 0xA9, 2, 4 + ord("x")]
    assert request(server.url, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False}, bearer()) == \
        (200, {"tokens": ids, "count": 5, "max_model_len": 64})
    # As /v1/completions and `mseq generate` encode a text prompt: after a </s>.
    assert request(server.url, "POST", "/tokenize", {"prompt": text}, bearer())[1]["tokens"] == [2] + ids
    assert request(server.url, "POST", "/detokenize", {"tokens": [2] + ids}, bearer()) == \
        (200, {"prompt": "</s>" + text})
    completions_url = f"{server.url}/v1/completions"
    assert check_remote_tokenizer_support(completions_url, auth_token=API_KEY)
    remote = RemoteTokenizer(completions_url, auth_token=API_KEY)
    assert (remote.eos_token_id, remote.bos_token_id) == (2, 2)
    assert remote.encode(text) == ids and remote.decode(ids) == text


TOKENIZER_ERRORS = {
    "tokenize_without_prompt": ("/tokenize", {"add_special_tokens": False}, ["prompt is required"], "prompt"),
    "tokenize_a_list": ("/tokenize", {"prompt": [5, 6]}, ["prompt: input should be a valid string"], "prompt"),
    "tokenize_flag_not_bool": ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, ["add_special_tokens"],
                               "add_special_tokens"),
    "tokenize_unknown_field": ("/tokenize", {"prompt": "x", "tokens": [5]}, ["unknown field 'tokens'"], "tokens"),
    "detokenize_out_of_vocabulary": ("/detokenize", {"tokens": [5, 99999]}, ["token id 99999", "0..263"], "tokens"),
    "detokenize_negative": ("/detokenize", {"tokens": [-1]}, ["token id -1"], "tokens"),
    "detokenize_text": ("/detokenize", {"tokens": ["a"]}, ["tokens.0: input should be a valid integer"], "tokens"),
    "detokenize_not_json": ("/detokenize", b"[1, 2", ["not valid JSON"], None),
}


@pytest.mark.parametrize("name", sorted(TOKENIZER_ERRORS))
def test_a_bad_tokenizer_request_is_a_one_line_400(server, name):
    path, body, needles, param = TOKENIZER_ERRORS[name]
    _one_line_error(*request(server.url, "POST", path, body, bearer()), 400, *needles, param=param)


def test_tokenizer_routes_need_the_key(server):
    for method, path, body in [("GET", "/tokenizer_info", None), ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [5]})]:
        _one_line_error(*request(server.url, method, path, body), 401, "no API key")
        assert request(server.url, method, path, body, bearer())[0] == 200


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_echo_of_a_tokenized_prompt_has_one_entry_per_id_sent(interface, server, batching):
    """lm-eval reads a continuation's log-probabilities as token_logprobs[context_length:-1] of the
    echoed token ids it sent: every id needs its entry, the leading </s> included; a text
    prompt's echo leaves out the </s> the server put before it. Both batchers make the results."""
    fields = dict(temperature=0, max_tokens=1, logprobs=1, echo=True)
    with contextlib.ExitStack() as stack:
        url = server.url if batching == "continuous" else \
            stack.enter_context(server_thread(interface, batching=batching)).url
        text_answer = _client(url).completions.create(model="tiny", prompt="abc", extra_body={"min_tokens": 1}, **fields)
        ids = [2, 4 + ord("a"), 4 + ord("b"), 4 + ord("c")]
        tokens_answer = _client(url).completions.create(model="tiny", prompt=ids, extra_body={"min_tokens": 1},
                                                     **fields)
    text, tokens = text_answer.choices[0], tokens_answer.choices[0]
    # `usage` counts the new token only: the echoed prompt as sent (here 4 ids) is not new.
    assert tokens_answer.usage.completion_tokens == 1 and tokens_answer.usage.prompt_tokens == 4
    assert tokens.text == text.text and tokens.text.startswith("abc")
    assert tokens.logprobs.tokens == [""] + text.logprobs.tokens and len(tokens.logprobs.tokens) == len(ids) + 1
    assert tokens.logprobs.text_offset == [0] + text.logprobs.text_offset == [0, 0, 1, 2, 3]
    assert tokens.logprobs.token_logprobs[0] is None and tokens.logprobs.top_logprobs[0] is None
    assert tokens.logprobs.token_logprobs[1:] == pytest.approx(text.logprobs.token_logprobs, abs=1e-6)
    assert tokens.logprobs.top_logprobs[1:] == text.logprobs.top_logprobs
