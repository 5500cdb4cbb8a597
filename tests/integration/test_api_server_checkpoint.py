"""`launch/api_server.py --checkpoint=DIR` end to end: a tiny Qwen2 checkpoint and its tokenizer
written by transformers are served by a local cluster; a chat request's greedy tokens equal
transformers' own `generate` on the chat template's ids, and SIGTERM stops the server and every
engine it started."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "model"))
from hf_reference import write_hf  # noqa: E402
from test_hf import QWEN2 as HF_QWEN2  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.hf]

VOCAB = 257
QWEN2 = {**HF_QWEN2, "num_hidden_layers": 2}
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def _write_tokenizer(path: pathlib.Path) -> None:
    """A word-level tokenizer over all 257 ids (so every generated id decodes), with a ChatML-like
    template and `<|im_end|>` as its end of turn."""
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "<|im_end|>", "<|im_start|>", "user", "assistant", "system"]
    words += "hello world the answer is 42".split()  # the server's probe text
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    raw = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>", chat_template=TEMPLATE
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(path)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_serving_a_checkpoint_with_its_tokenizer(tmp_path, report_logs):
    import torch

    ckpt = tmp_path / "tiny-qwen2-chat"
    hf = write_hf(ckpt, "Qwen2ForCausalLM", QWEN2, seed=4).hf
    _write_tokenizer(ckpt)
    # The tokenizer as its files describe it: beside a Qwen2 config.json, AutoTokenizer maps
    # this word-level tokenizer.json to a BPE Qwen2Tokenizer that encodes words to nothing, and
    # the server serves the file as written instead (tokenizer.load_tokenizer).
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(ckpt)
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w7 w8 w9"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert tok.convert_tokens_to_ids("w7") in ids  # the words are in the prompt
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    want = out[0, len(ids) :].tolist()

    workdir = tmp_path / "run"
    report_logs(workdir)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "launch/api_server.py",
        "--config=configs/cpu_1p1d.py",
        f"--checkpoint={ckpt}",
        "--port=0",
        f"--workdir={workdir}",
        # warm-up on (the default) over small buckets: contexts of 512, forwards of 2 x 128
        "--set=cluster.decode_max_len=512",
        "--set=cluster.prefill_max_tokens=128",
        "--set=cluster.prefill_max_batch=2",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        info_file = workdir / "api_server.json"
        deadline = time.monotonic() + 300
        while not info_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert info_file.exists(), proc.stdout.read() if proc.poll() is not None else "no start"
        info = json.loads(info_file.read_text())
        while proc.poll() is None and time.monotonic() < deadline:  # compiling: 503
            try:
                with urllib.request.urlopen(info["url"] + "/health", timeout=10) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError as e:
                assert e.code == 503, e
            time.sleep(0.5)
        assert info["model"] == "tiny-qwen2-chat"
        api = openai.OpenAI(base_url=info["url"] + "/v1", api_key="-", max_retries=0, timeout=180)
        assert [m.id for m in api.models.list()] == ["tiny-qwen2-chat"]
        r = api.chat.completions.create(
            model="tiny-qwen2-chat",
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert r.choices[0].model_extra["token_ids"] == want
        assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(ids)
        engines = _children(proc.pid)
        assert len(engines) >= 3  # the router and two engines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert re.search(r"context: \d+ tokens, (set by cluster.decode_max_len|the model's)", out)
    for pid in engines:  # every process the server's cluster started has exited
        assert not pathlib.Path(f"/proc/{pid}").exists() or "Z" in _state(pid), pid


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
