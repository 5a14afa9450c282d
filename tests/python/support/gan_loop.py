"""A GAN-style training loop with two optimizers per batch, as pytorch/examples' DCGAN
writes it (small MLPs on the CPU, so a run takes seconds): per batch, a discriminator
update (the generator's forward on noise, D on the real and the detached fake batch, D's
backward, ``optD.step()``), then a generator update (D on the fake batch again,
backward through D and G, ``optG.step()``). The two updates cost differently (D's about
twice G's). Run unmodified under ``steptrace run``, each ``optimizer.step()`` ends a step:
two steps per batch, alternating D and G.

``--slow-g-from N --slow-g-matmuls K``: from batch N on, G's forward does K extra
192x192 matmuls (an injected regression; it lands in the D steps, where G runs forward).

    steptrace run --log-dir runs/gan tests/python/support/gan_loop.py --batches 800
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self, nz: int = 32, out: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(nz, 128), nn.ReLU(), nn.Linear(128, out), nn.Tanh())
        self.extra = 0  # injected work (matmuls) in forward
        self.w = torch.randn(192, 192) / 192**0.5

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # noqa: D102
        acc = self.w
        for _ in range(self.extra):
            acc = torch.tanh(acc @ self.w)
        return self.net(z) + 0.0 * acc.mean()


def discriminator(inp: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(inp, 384), nn.LeakyReLU(0.2), nn.Linear(384, 384), nn.LeakyReLU(0.2),
                         nn.Linear(384, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-g-from", type=int, default=-1)
    p.add_argument("--slow-g-matmuls", type=int, default=0)
    p.add_argument("--regenerate", action="store_true",
                   help="G's update runs G forward again on new noise (as many GAN scripts do): "
                        "G's forward then runs in both updates")
    a = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    data = torch.utils.data.TensorDataset(torch.randn(a.batches * a.batch_size, 128))
    loader = torch.utils.data.DataLoader(data, batch_size=a.batch_size, shuffle=True)
    netG, netD = Generator(), discriminator()
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    for i, (real,) in enumerate(loader):
        if i == a.slow_g_from:
            netG.extra = a.slow_g_matmuls
        n = real.shape[0]
        ones, zeros = torch.ones(n, 1), torch.zeros(n, 1)
        # (1) D: maximize log D(x) + log(1 - D(G(z)))
        netD.zero_grad()
        fake = netG(torch.randn(n, 32))
        errD = bce(netD(real), ones) + bce(netD(fake.detach()), zeros)
        errD.backward()
        optD.step()
        # (2) G: maximize log D(G(z))
        netG.zero_grad()
        if a.regenerate:
            fake = netG(torch.randn(n, 32))
        errG = bce(netD(fake), ones)
        errG.backward()
        optG.step()
    print(f"{i + 1} batches, loss D {errD.item():.3f} G {errG.item():.3f}")


if __name__ == "__main__":
    main()
