"""How a CUDA-graph replay of many tiny kernels costs: host launch time vs device time.

Records graphs of 2·n tiny in-place kernels (n = 350, 700) whole, as two halves and as four
quarters, and reports per variant the median wall time of a replay (launch → completion), the
host time of the launch calls alone, and the device time between events around it. It decides
whether splitting the captured step into several graphs (so the device starts while the host
still launches) can pay: only if the host launch time is a visible share of the wall time.
"""

from __future__ import annotations

import statistics
import time

import torch

EDGES_192_ATOMS = 17_064  # a 192-atom water step's edge count: kernels of that size


def _body(x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        x.mul_(1.0000001).add_(1e-7)


def _record(x: torch.Tensor, n: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _body(x, 2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _body(x, n)
    return graph


def main() -> None:
    x = torch.zeros(EDGES_192_ATOMS * 8, device="cuda")
    for total in (350, 700):
        variants = {
            "one": [_record(x, total)],
            "two": [_record(x, total // 2) for _ in range(2)],
            "four": [_record(x, total // 4) for _ in range(4)],
        }
        for name, graphs in variants.items():
            walls, launches, device = [], [], []
            for i in range(60):
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                for graph in graphs:
                    graph.replay()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                t2 = time.perf_counter()
                if i >= 10:
                    walls.append((t2 - t0) * 1e3)
                    launches.append((t1 - t0) * 1e3)
                    device.append(start.elapsed_time(end))
            print(
                f"kernels {2 * total} graphs {name}: wall {statistics.median(walls):.3f} ms, "
                f"host launch {statistics.median(launches):.3f}, "
                f"gpu(events) {statistics.median(device):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
