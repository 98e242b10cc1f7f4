"""Language models: labels of any shape with the user's loss, per-token accuracy and perplexity, loss targets, the
small GPT, the text corpus and its windows, and a tied model's export."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from crossbow_mpi.config import Config, ConfigError
from crossbow_mpi.data.checks import check_samples
from crossbow_mpi.data.datasets import DataError, load_text
from crossbow_mpi.data.prepare import prepare_text
from crossbow_mpi.models import TinyGPT, build_model, token_cross_entropy
from crossbow_mpi.replicas.state import TrainState
from crossbow_mpi.train import parse_config
from crossbow_mpi.training.hooks import hits
from crossbow_mpi.training.trainer import Trainer

from helpers import metrics_records, run_config, run_job, run_tool

TEXT = b"the quick brown fox jumps over the lazy dog; " * 40


class Sequences(Dataset):
    """Windows of a repeated text as a plain map-style dataset: a [T] input and its [T] next-byte labels."""

    def __init__(self, repeats: int, seq_len: int = 8):
        self.data = torch.tensor(list(TEXT * repeats))
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int):
        window = self.data[index * self.seq_len : (index + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def small_gpt() -> TinyGPT:
    return TinyGPT(vocab=256, seq_len=8, layers=1, heads=2, width=16)


def test_text_windows_are_each_bytes_next_byte_and_the_splits_do_not_overlap(tmp_path):
    (tmp_path / "mine.txt").write_bytes(TEXT)
    prepare_text(tmp_path / "text", tmp_path / "mine.txt", max_bytes=0)
    manifest = json.loads((tmp_path / "text" / "MANIFEST.json").read_text())
    assert manifest["sha256"] == hashlib.sha256(TEXT).hexdigest() and manifest["bytes"] == len(TEXT)
    train, test = load_text(tmp_path / "text", seq_len=8)
    assert len(train.data) + len(test.data) == len(TEXT) and len(test.data) == len(TEXT) // 10
    inputs, labels = train.get_batch(torch.tensor([0, 3]))
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (2, 8)
    assert bytes(inputs[1].tolist()) == TEXT[24:32] and bytes(labels[1].tolist()) == TEXT[25:33]
    assert len(train) == (len(train.data) - 1) // 8


def test_the_default_corpus_is_the_standard_librarys_sources_with_each_files_digest(tmp_path):
    prepare_text(tmp_path, None, max_bytes=20_000)
    manifest = json.loads((tmp_path / "MANIFEST.json").read_text())
    text = (tmp_path / "corpus.txt").read_bytes()
    assert len(text) == manifest["bytes"] == 20_000 and manifest["python"]
    assert sum(f["bytes"] for f in manifest["files"]) == len(text)
    assert (tmp_path / "SHA256SUMS").read_text() == f"{hashlib.sha256(text).hexdigest()}  corpus.txt\n"


def test_a_corpus_smaller_than_a_window_or_changed_since_is_one_line(tmp_path):
    (tmp_path / "mine.txt").write_bytes(TEXT[:100])
    prepare_text(tmp_path / "text", tmp_path / "mine.txt", max_bytes=0)
    with pytest.raises(DataError, match="too few for --seq-len 16"):
        load_text(tmp_path / "text", seq_len=16)  # the test split holds 10 bytes
    (tmp_path / "text" / "corpus.txt").write_bytes(TEXT[:99])
    with pytest.raises(DataError, match="SHA-256 mismatch"):
        load_text(tmp_path / "text", seq_len=4)


def test_tinygpt_is_causal_with_its_output_tied_to_its_token_embedding():
    torch.manual_seed(0)
    model = small_gpt().eval()
    tokens = torch.randint(0, 256, (2, 8))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 256
    out, out_changed = model(tokens), model(changed)
    assert out.shape == (2, 8, 256) and model.head.weight is model.tokens.weight
    assert torch.equal(out[:, :5], out_changed[:, :5]) and not torch.equal(out[:, 5:], out_changed[:, 5:])
    with pytest.raises(ValueError, match="width 30 is not divisible by the 4 heads"):
        build_model("tinygpt", (8,), 256, "width=30,heads=4")
    with pytest.raises(ValueError, match="model 'lenet' has no argument 'layers'"):
        build_model("lenet", (1, 28, 28), 10, "layers=2")


def test_accuracy_is_per_sample_or_per_token_and_absent_for_other_shapes():
    scores = torch.tensor([[[0.0, 1.0], [2.0, 0.0]]])  # [B=1, T=2, V=2]
    assert hits(scores, torch.tensor([[1, 1]])).tolist() == [[True, False]]
    assert hits(scores[:, 0], torch.tensor([1])).tolist() == [True]
    assert hits(scores, torch.tensor([1])) is None
    assert hits(scores[:, 0], torch.tensor([[0.5, 0.5]])) is None
    assert hits((scores,), torch.tensor([[1, 1]])) is None  # a tuple output without an output_fn


def test_with_the_users_loss_the_start_up_check_asks_only_for_a_finite_number():
    model, data = small_gpt(), Sequences(1)
    check_samples(model, torch.float32, data, "training set", loss_fn=token_cross_entropy)
    with pytest.raises(DataError, match="has a label of shape \\(8,\\), not one class index; pass fit"):
        check_samples(model, torch.float32, data, "training set", output_fn=lambda out: out[:, -1])
    with pytest.raises(DataError, match="is shape \\(1, 8\\), not one number"):
        check_samples(
            model,
            torch.float32,
            data,
            "training set",
            loss_fn=lambda out, y: F.cross_entropy(out.transpose(1, 2), y, reduction="none"),
        )
    with pytest.raises(DataError, match="is nan, not a finite number"):
        check_samples(model, torch.float32, data, "training set", loss_fn=lambda out, y: out.sum() * math.nan)


def test_a_loss_target_is_a_positive_number_or_unset_and_old_checkpoints_read_back():
    assert parse_config(["--target-loss", "1.5"]).target_loss == 1.5
    assert parse_config(["--target-loss", "none"]).target_loss is None and Config().target_loss is None
    for bad in ("0", "-1", "inf"):
        with pytest.raises(ConfigError, match="--target-loss must be"):
            parse_config(["--target-loss", bad]).validate(["sma"])
    with pytest.raises(ConfigError, match="--seq-len must be positive, got 0"):
        parse_config(["--seq-len", "0"]).validate(["sma"])
    assert TrainState.from_dict({"time_to_accuracy_s": 3.0}).time_to_target_s == 3.0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["sma", pytest.param("ssgd", marks=pytest.mark.slow)])
def test_a_next_token_model_trains_to_a_loss_target_with_per_token_accuracy_and_perplexity(comm, shared_tmp, algorithm):
    torch.manual_seed(0)
    cfg = run_config(
        shared_tmp, algorithm=algorithm, learners=2, epochs=20, eval_every=480, target_loss=2.0, lr=0.3, weight_decay=0
    )
    result = Trainer(cfg).fit(small_gpt, Sequences(3), Sequences(1), token_cross_entropy)
    records = metrics_records(comm, shared_tmp / "run")
    evaluations, summary = [r for r in records if "test_loss" in r], records[-1]
    assert result.reached and result.time_to_target_s == result.time_to_accuracy_s  # each rank's own clock
    assert summary["time_to_target_s"] == evaluations[-1]["time_s"]
    assert [r["test_loss"] <= 2.0 for r in evaluations] == [False] * (len(evaluations) - 1) + [True]
    assert all(r["test_perplexity"] == pytest.approx(math.exp(r["test_loss"])) for r in evaluations)
    assert all(0 <= r["test_accuracy"] <= 1 and r["target_loss"] == 2.0 for r in evaluations)
    assert summary["final_test_perplexity"] == result.test_perplexity and result.epochs < 20


@pytest.mark.mpi(min_size=1)
def test_a_metric_fn_decides_the_accuracy_and_none_reports_none(comm, shared_tmp):
    cfg = run_config(shared_tmp, learners=1, epochs=1)
    result = Trainer(cfg).fit(
        small_gpt, Sequences(2), Sequences(1), token_cross_entropy, metric_fn=lambda out, labels: None
    )
    assert result.test_accuracy is None and result.test_perplexity is None
    assert metrics_records(comm, shared_tmp / "run")[-1]["final_test_accuracy"] is None


@pytest.mark.slow
def test_tinygpt_on_text_from_the_command_line_reaches_its_loss_target_and_exports_tied_once(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    (tmp_path / "mine.txt").write_bytes(TEXT * 4)
    data, run = tmp_path / "text", tmp_path / "run"
    assert (
        run_tool("crossbow_mpi.data.prepare", "text", str(data), "--source", str(tmp_path / "mine.txt")).returncode == 0
    )
    flags = ["--model", "tinygpt", "--model-args", "layers=1,heads=2,width=16", "--dataset", "text"]
    flags += ["--data-dir", str(data), "--seq-len", "16", "--target-accuracy", "0", "--target-loss", "5"]
    done = run_job(1, [*flags, "--run-dir", str(run), "--eval-every", "200", "--threads", "1", "--lr", "0.1"])
    assert done.returncode == 0, done.stderr
    assert "reached test loss 5 in" in done.stdout
    exported = tmp_path / "model.safetensors"
    assert run_tool("crossbow_mpi.export", str(run), "--out", str(exported)).returncode == 0
    with safe_open(str(exported), "pt") as f:
        assert json.loads(f.metadata()["tied"]) == {"head.weight": "tokens.weight"}
    model = build_model("tinygpt", (16,), 256, "layers=1,heads=2,width=16")
    missing, unexpected = model.load_state_dict(load_file(exported), strict=False)
    assert missing == ["head.weight"] and not unexpected and model.head.weight is model.tokens.weight
    shown = run_tool("crossbow_mpi.report", str(run), "--out", str(tmp_path / "report.png"))
    assert shown.returncode == 0 and "final test accuracy" in shown.stdout and "test loss 5 reached in" in shown.stdout
