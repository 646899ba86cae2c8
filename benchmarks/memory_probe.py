"""Peak resident memory of one inference call, measured in a fresh process.

    python -m benchmarks.memory_probe IMPL BATCHxSEQxEMBEDxHEADS THREADS

prints JSON {"baseline_mb", "peak_mb"}: ru_maxrss after building the inputs and after one
forward under torch.inference_mode. A fresh process per measurement, because ru_maxrss never
goes down.
"""
import json
import resource
import sys

import torch

from benchmarks import layers as bench


def main() -> None:
    impl, shape_text, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(threads)
    shape = bench.Shape.parse(shape_text)
    layer, x = bench.make_layer(impl, shape)
    layer.eval()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.inference_mode():
        bench.call_layer(impl, layer, x)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"baseline_mb": baseline / 1024, "peak_mb": peak / 1024}))


if __name__ == "__main__":
    main()
