"""``GradcompDDPStrategy`` (gradcomp.training.lightning): a real Lightning ``Trainer`` on 2 CPU
processes (gloo, launched as torchrun would) registers gradcomp's hook, sends compressed bytes,
and a run resumed from a Lightning checkpoint continues bit-identically to the uninterrupted one
(the checkpoint carries every rank's hook state; without it the runs differ). Construction
refuses what it cannot honour, and importing the module without Lightning names the package.
Skipped when PyTorch Lightning is not installed (CI installs it)."""
import importlib
import os
import sys

import pytest
import torch

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install lightning)")

from ranks import run_ranks  # noqa: E402

from gradcomp.training.lightning import CHECKPOINT_KEY, GradcompDDPStrategy  # noqa: E402

STEPS_PER_EPOCH = 8  # 128 samples, batch 8 per rank, 2 ranks


def _module():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # 64x32 = 2048 elements: compressed by PowerSGD; the 4x64 head and biases stay dense
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Net()


def _fit(epochs: int, ckpt_path=None, save=None):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from gradcomp.collectives import reset_telemetry, telemetry

    pl.seed_everything(0, verbose=False)
    model = _module()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 32, generator=g)
    data = DataLoader(TensorDataset(x, (x[:, :4] * 3).argmax(1)), batch_size=8)
    strategy = GradcompDDPStrategy("powersgd", rank=2, find_unused_parameters=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=epochs, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    reset_telemetry()
    trainer.fit(model, data, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    assert strategy.hook_state is not None  # kept after fit, for trainer.save_checkpoint
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return weights, telemetry()["total"]["bytes_sent"], (trainer.global_step, strategy.hook_state.iteration)


def _lightning_rank(rank, world, folder):
    import torch.distributed as dist

    out = {}
    straight, sent, steps = _fit(2)
    out["sent_per_step"], out["steps"] = sent / steps[0], steps
    ckpt = os.path.join(folder, "one-epoch.ckpt")
    _fit(1, save=ckpt)
    if rank == 0:
        saved = torch.load(ckpt, weights_only=False)
        out["saved"] = saved[CHECKPOINT_KEY]["world_size"], [s["iteration"] for s in saved[CHECKPOINT_KEY]["ranks"]]
        del saved[CHECKPOINT_KEY]
        torch.save(saved, os.path.join(folder, "without-gradcomp.ckpt"))
    dist.barrier()
    resumed, _, out["resumed_steps"] = _fit(2, ckpt_path=ckpt)
    out["resumed_equal"] = torch.equal(resumed, straight)
    blind, _, out["blind_steps"] = _fit(2, ckpt_path=os.path.join(folder, "without-gradcomp.ckpt"))
    out["blind_equal"] = torch.equal(blind, straight)
    return out


def test_strategy_trains_compressed_and_resumes_bit_identically(tmp_path):
    results = run_ranks(_lightning_rank, 2, tmp_path, str(tmp_path), timeout_s=120.0, torchrun_env=True)
    dense = 4 * (32 * 64 + 64 + 64 * 4 + 4)  # fp32 gradient bytes one rank sends per step in a 2-rank ring
    two = 2 * STEPS_PER_EPOCH
    for r in results:
        assert r["steps"] == (two, two) == r["resumed_steps"]  # (Lightning's steps, the hook's iterations)
        assert r["blind_steps"] == (two, STEPS_PER_EPOCH)  # without the state the hook counts from 0
        assert 0 < r["sent_per_step"] < dense / 2, r  # the hook ran (DDP's own allreduce counts 0) and compressed
        assert r["resumed_equal"], "the resumed run differs from the uninterrupted one"
        # the control: the same resume without the hook state (residuals, warm start) differs
        assert not r["blind_equal"], "resuming without the hook state changed nothing: the test proves nothing"
    assert results[0]["saved"] == (2, [STEPS_PER_EPOCH, STEPS_PER_EPOCH])


def test_construction_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="unknown"):
        GradcompDDPStrategy("nosuchcompressor")
    with pytest.raises(ValueError, match="unknown keyword"):
        GradcompDDPStrategy("topk", ratioo=0.01)
    with pytest.raises(ValueError, match="its own communication hook"):
        GradcompDDPStrategy("topk", ddp_comm_hook=lambda s, b: None)
    s = GradcompDDPStrategy("topk", ratio=0.01, error_feedback="ef", find_unused_parameters=True, timeout=None)
    assert s._ddp_kwargs == {"find_unused_parameters": True}  # DDP's keywords go to DDP, the rest to the hook
    assert s._gradcomp["options"] == {"ratio": 0.01, "error_feedback": "ef"}
    with pytest.raises(ValueError, match="hook states of 2 ranks, this run has 1"):
        s.load_model_state_dict({"state_dict": {}, CHECKPOINT_KEY: {"world_size": 2, "ranks": [{}, {}]}})
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["gradcomp_ddp"]["strategy"] is GradcompDDPStrategy


def test_import_without_lightning_names_the_package(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.strategies", "pytorch_lightning",
                 "pytorch_lightning.strategies"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "gradcomp.training.lightning")
    with pytest.raises(ImportError, match="pip install lightning"):
        importlib.import_module("gradcomp.training.lightning")
    monkeypatch.undo()
    assert importlib.import_module("gradcomp.training.lightning").GradcompDDPStrategy is GradcompDDPStrategy
