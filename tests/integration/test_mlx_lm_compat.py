"""mlx-lm behind one seam (daemon/mlx_lm_compat.py), on real objects of the tiny model: the
installed mlx-lm still has every private name `PRIVATE_NAMES` lists, on a sample object of each
owner (tests/mlx_lm_samples.py; a missing one is named), and the tokenizer the seam unwraps is
Hugging Face's. The source scan and the version range are tests/unit/test_mlx_lm_compat.py's."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from mlx_lm_samples import SAMPLES, resolve
from mlxcel.daemon import mlx_lm_compat as compat
from mlxcel.daemon.mlx_lm_compat import PRIVATE_NAMES


def test_every_owner_has_a_sample() -> None:
    assert sorted(set(PRIVATE_NAMES) - set(SAMPLES)) == [], "add a sample object to SAMPLES"


@pytest.mark.parametrize("owner", sorted(PRIVATE_NAMES))
def test_the_installed_mlx_lm_has_every_private_name(
    owner: str, request: pytest.FixtureRequest
) -> None:
    version = metadata.version("mlx-lm")
    kind = resolve(owner)  # an ImportError / AttributeError names the owner itself
    sample = SAMPLES[owner](request)
    if isinstance(kind, type):
        assert type(sample) is kind, f"the sample of {owner} is a {type(sample).__name__}"
    missing = [f"{owner}.{name}" for name in PRIVATE_NAMES[owner] if not hasattr(sample, name)]
    assert missing == [], (
        f"mlx-lm {version} no longer has {', '.join(missing)} "
        "(daemon/mlx_lm_compat.py uses it; adapt the seam, or pin mlx-lm to the tested range)"
    )


def test_wrapped_tokenizer_is_the_hugging_face_one(tiny_model_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load

    wrapper = load(tiny_model_dir)
    inner = compat.wrapped_tokenizer(wrapper)
    assert inner is not wrapper and hasattr(inner, "backend_tokenizer")
