"""One cache decode step of one layer (C backend, int4, 512 tokens held, B 1, Hkv 3, D 64), the same position each
time: runs against whichever checkout's ``qsinkkv`` is first on the path."""
import timeit

import torch

from qsinkkv import CacheConfig, SinkQuantCache


def main():
    torch.set_num_threads(1)
    cfg = CacheConfig(sink_tokens=4, recent_tokens=541, bits=4, block_size=64, value_group_size=64)
    cache = SinkQuantCache(cfg, 1, 1, 3, 64, dtype=torch.float32, backend="c")
    g = torch.Generator().manual_seed(0)
    cache.attend(0, *(torch.randn(1, h, 512, 64, generator=g) for h in (9, 3, 3)))
    q, k, v = (torch.randn(1, h, 1, 64, generator=g) for h in (9, 3, 3))

    def step():
        cache.attend(0, q, k, v)
        cache.layers[0].seq_lens -= 1  # (the same position again)
    n = 3000
    print(f"{min(timeit.repeat(step, number=n, repeat=5)) / n * 1e6:.1f} us per decode step (one layer)")


if __name__ == "__main__":
    main()
