"""What a newcomer sees from `make train`: its command (`python recipes/train.py`, the `tiny` preset) on the suite's
corpus for 40 steps, with a fresh data cache so that data preparation runs inside the launch. One launch serves
every test here: the console holds the project's lines and none of the third-party noise, the picture and the
summary are there, and the samples read as text.

The suite's corpus has 16 distinct words, so a sample's share of distinct words is at most 16 / its words: the
launch draws 32-token samples (11-16 words), where this model's samples measured 0.62-0.87 (seeds 42, 1, 2) and a
repetition loop would give a few percent; their loss under the model measured 1.2-1.7 nats, against ln(384) = 5.95
for chance.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import matplotlib.image
import pytest
import torch
from launching import launch, launcher_command, quiet_console_problems
from transformers import AutoModelForCausalLM, AutoTokenizer

from data import prepare_data
from recipes import plot_curves
from training.arguments import parse_run_config
from training.report.curves import CURVES
from training.report.sample import draw_samples, validation_prompts

STEPS, SAVE_STEPS, SAMPLE_TOKENS, SAMPLES, SEED = 40, 20, 32, 3, 42
FLAGS = [
    f"--max_steps={STEPS}", f"--save_steps={SAVE_STEPS}", "--eval_steps=20", "--logging_steps=10",
    f"--sample_max_new_tokens={SAMPLE_TOKENS}", f"--sample_count={SAMPLES}", f"--seed={SEED}",
]  # fmt: skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def first_run(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("first_run")
    flags = [f for f in corpus["flags"] if not f.startswith("--cache_dir=")] + [f"--cache_dir={root / 'cache'}"]
    run = launch(launcher_command("python"), [*flags, *FLAGS], root / "out")
    run.cfg = parse_run_config(flags)  # its data flags: the cache the launch prepared
    return run


def summary_rows(stdout: str) -> dict[str, str]:
    block = stdout.split("***** run summary *****\n", 1)[1]
    return dict(re.findall(r"^  (\S.*?)  +(\S.*)$", block, flags=re.MULTILINE))


def test_the_console_has_the_projects_lines_and_no_noise(first_run):
    console = first_run.stdout + first_run.stderr
    assert quiet_console_problems(console) == []
    # MFU needs a device's peak FLOP/s; on CPU the column is left out rather than `n/a` on every line.
    assert "MFU" not in console
    step_lines = [line for line in first_run.stdout.splitlines() if re.match(r"step +\d+ \| loss ", line)]
    assert len(step_lines) == STEPS // 10
    for step in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS):
        assert (first_run.output_dir / f"checkpoint-{step}").is_dir()
        assert re.search(rf"saved checkpoint-{step} \([\d.,]+ MB\) to {first_run.output_dir}\n", console)
    assert f"training curves: {first_run.output_dir / CURVES}" in first_run.stdout


def test_the_summary_says_what_was_trained_and_how_to_use_it(first_run):
    rows = summary_rows(first_run.stdout)
    records = first_run.records
    tokens = STEPS * 8 * 64  # the default micro batch of 8 sequences x --block_size 64, one rank
    assert rows["steps"] == f"{STEPS} ({tokens:,} tokens seen)"
    last_loss = [r["loss"] for r in records if "loss" in r][-1]
    last_eval = [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    assert rows["train loss"].startswith(f"{last_loss:.4f}") and rows["eval loss"].startswith(f"{last_eval:.4f}")
    assert re.fullmatch(r"[\d,]+ tokens/s on 1 x CPU \(training steps only\)", rows["throughput"])
    assert re.fullmatch(r"host \d+\.\d\d GB resident", rows["peak memory rank 0"])
    assert rows["model"] == str(first_run.output_dir)
    # The two printed lines load the export and generate from it.
    code = "\n".join(line.strip() for line in first_run.stdout.splitlines()[-2:])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    assert printed.getvalue().startswith("def ") and len(printed.getvalue()) > len("def ")


def test_the_picture_is_drawn_at_the_end_and_from_any_metrics_file(first_run, tmp_path, capsys):
    at_end = matplotlib.image.imread(first_run.output_dir / CURVES)
    assert at_end.ndim == 3 and at_end.shape[0] > 400 and at_end.std() > 0  # a picture, not a blank page
    plot_curves.main([str(first_run.output_dir / "metrics.jsonl"), "--out", str(tmp_path / "again.png")])
    assert capsys.readouterr().out == f"training curves: {tmp_path / 'again.png'}\n"
    assert matplotlib.image.imread(tmp_path / "again.png").shape == at_end.shape


def test_the_samples_read_as_text(first_run):
    """The printed samples are the seeded draw from the export; each is no repetition loop, and the model finds
    its own samples far likelier than chance (loss well below ln(vocabulary))."""
    out = first_run.output_dir
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    gen = model.generation_config
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.max_new_tokens) == (True, 0.8, 200, SAMPLE_TOKENS)
    validation = prepare_data(first_run.cfg).validation
    prompts = validation_prompts(validation, tokenizer.eos_token_id, SAMPLES)
    samples = draw_samples(model, prompts, gen, SEED)
    assert len(samples) == SAMPLES
    assert f"--- {SAMPLES} samples (temperature 0.8, top-k 200, seed {SEED})" in first_run.stdout
    for prompt, sample in zip(prompts, samples, strict=True):
        text = tokenizer.decode(prompt + sample)
        assert f"{text}\n---" in first_run.stdout  # the same draw as the run's: the seed fixes it
        words = tokenizer.decode(sample).split()
        assert len(words) >= 8 and len(set(words)) / len(words) >= 0.3, words
        ids = torch.tensor([prompt + sample])
        labels = ids.clone()
        labels[0, : len(prompt)] = -100  # the loss of the sampled tokens alone
        with torch.no_grad():
            loss = model(ids, labels=labels).loss.item()
        assert loss < 0.5 * math.log(model.config.vocab_size), (loss, text)
    assert json.loads((out / "run_config.json").read_text())["preset"] == "tiny"  # `make train`'s model
