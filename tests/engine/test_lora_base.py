"""A LoRA checkpoint records its base's weights_fingerprint; a resume onto other base weights is
refused before any weight is read (config/resume.check_lora_base, the trainer's check) and
again as the adapters load (model.path pointed at another model of the same architecture
trained the saved adapters on the wrong base, silently), and the same base copied elsewhere
resumes."""
import shutil

import pytest

from tests.models import hf_factory
from tests.models.lora_bodies import lora_checkpoint_body, lora_resume_body
from tests.multiproc import run_on_ranks
from verl_mcore.config.resume import ResumeConfigError, check_lora_base
from verl_mcore.convert_hf.verify import prompts
from verl_mcore.utils.manifest import weights_fingerprint

TARGETS = ["q_proj", "down_proj"]
TOKENS = prompts(hf_factory.COMMON["vocab_size"], batch=1, seq_len=4)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    a = hf_factory.save_tiny_model("qwen2", str(root / "a"), seed=1)
    b = hf_factory.save_tiny_model("qwen2", str(root / "b"), seed=2)  # same shapes, other weights
    moved = str(root / "moved" / "a")
    shutil.copytree(a, moved)
    return a, b, moved


def test_fingerprint_follows_the_weights_not_the_path(bases):
    a, b, moved = bases
    assert weights_fingerprint(a) == weights_fingerprint(moved) != weights_fingerprint(b)


@pytest.fixture(scope="module")
def step(bases, tmp_path_factory):
    """A LoRA actor's adapter-only checkpoint, saved on base a."""
    [saved] = run_on_ranks(lora_checkpoint_body, 1, timeout=300,
                           args=(bases[0], 1, 1, TARGETS, TOKENS, 7,
                                 str(tmp_path_factory.mktemp("run") / "ckpt")))
    return saved["path"]


def test_the_trainers_check_refuses_other_base_weights_before_any_load(bases, step):
    a, b, moved = bases
    check_lora_base(step, moved)  # the same weights elsewhere
    with pytest.raises(ResumeConfigError, match=f"trained on the base {a}, and {b} .* holds other weights"):
        check_lora_base(step, b)


def test_resume_onto_other_base_weights_is_refused(bases, step):
    a, b, moved = bases
    [other] = run_on_ranks(lora_resume_body, 1, timeout=300, args=(b, TARGETS, step, 7))
    assert other and "holds other weights now" in other and b in other and a in other
    [same] = run_on_ranks(lora_resume_body, 1, timeout=300, args=(moved, TARGETS, step, 7))
    assert same is None
