"""PyTorch Lightning with gradcomp: ``strategy=GradcompDDPStrategy(compressor, **options)``.

    python examples/train_lightning.py --devices 2 --compressor powersgd      # CPU: 2 processes on gloo
    python examples/train_lightning.py --accelerator gpu --devices 8 --compressor topk

``GradcompDDPStrategy`` (``gradcomp.training.lightning``) is Lightning's ``DDPStrategy`` with
gradcomp's communication hook registered on the DDP model, on CPU (gloo) as on CUDA; its
keywords are ``ddp_comm_hook``'s (compressor options, ``error_feedback``, ``start_iter`` ...)
beside DDP's own (``find_unused_parameters`` ...). Lightning checkpoints carry every rank's
hook state, so ``trainer.fit(..., ckpt_path=...)`` resumes it. The data is synthetic (a random
linear teacher); rank 0 prints the test accuracy and the bytes each rank sent per step.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ModuleNotFoundError as exc:  # say what to install, not a traceback
    raise SystemExit(f"train_lightning.py needs PyTorch Lightning: pip install 'gradcomp[lightning]' ({exc})") from None

from gradcomp.collectives import telemetry
from gradcomp.compress import available_compressors
from gradcomp.training.lightning import GradcompDDPStrategy


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        self.lr = lr

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def synthetic(n: int, seed: int):
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(1)


def main() -> None:
    p = argparse.ArgumentParser(description="gradcomp with PyTorch Lightning")
    p.add_argument("--compressor", default="powersgd", choices=available_compressors())
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    pl.seed_everything(0, verbose=False)
    model = Classifier(args.lr)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, max_steps=args.steps,
                         strategy=GradcompDDPStrategy(args.compressor),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = DataLoader(TensorDataset(*synthetic(4096, seed=1)), batch_size=32, shuffle=True)
    trainer.fit(model, loader)

    x, y = synthetic(2048, seed=2)
    with torch.no_grad():
        acc = (model.net(x.to(model.device)).argmax(1).cpu() == y).float().mean().item()
    sent = telemetry()["total"]["bytes_sent"]
    if trainer.global_rank == 0:
        print(f"lightning {args.compressor}: test accuracy {acc:.3f}, {sent / args.steps:.0f} bytes sent per step "
              f"per rank, world size {trainer.world_size}")


if __name__ == "__main__":
    main()
