"""Stand-in: sglang.bench_serving imports datasets at import; ShareGPT is read from a file."""


def load_dataset(*args, **kwargs):
    raise NotImplementedError("datasets stand-in: pass a local --dataset-path")
