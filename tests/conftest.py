"""Fixtures: a small synthetic CIFAR-10 in the real on-disk format (see helpers.py)."""
import pytest

from helpers import PYTHON, SMOKE, TEST_SIZE, TRAIN_SIZE, run


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory):
    """A synthetic CIFAR-10 in the real format, written by the documented command."""
    root = tmp_path_factory.mktemp("data") / "synthetic"
    run([PYTHON, "-m", "common.synthetic", "--data-dir", root, "--train-size", TRAIN_SIZE, "--test-size", TEST_SIZE])
    return root


@pytest.fixture
def data_args(cifar_dir):
    return ["--data-dir", cifar_dir, *SMOKE]
