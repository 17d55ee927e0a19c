import pytest

from tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_variant_dir(tmp_path_factory):
    """make(variant, tie) -> a directory, built once per combination."""
    built = {}

    def make(variant: str, tie: bool = True):
        key = (variant, tie)
        if key not in built:
            built[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{variant}"), variant, tie)
        return built[key]

    return make
