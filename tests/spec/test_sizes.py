"""cluster.memory_limit is read as Dask reads it, without importing Dask in the spec (L6)."""

from __future__ import annotations

import pytest
from dask.utils import parse_bytes

from dtrain.spec.sizes import MIN_MEMORY_LIMIT, memory_limit_bytes, parse_size

FORMS = ["4GiB", "4 GiB", "512MB", "512mb", "1.5 GB", "100M", "5kB", "5.4 kB", "1kiB", "1KiB", "2Gi", "1 TiB",
         "64MiB", "1e6", "1e6 kB", "1.e3MB", ".5GB", "100", "0", "GB", "3 PB", "7b", "2e-3 TB"]


@pytest.mark.parametrize("text", FORMS)
def test_parse_size_agrees_with_dask(text):
    assert parse_size(text) == parse_bytes(text)


@pytest.mark.parametrize("text", ["banana", "4 GiBs", "-1GB", "4G iB x", "1,5GB", "", "1e999GB", "nanGB", "inf"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_memory_limit_forms():
    assert memory_limit_bytes("4GiB") == 4 * 2**30
    assert memory_limit_bytes("auto") is None and memory_limit_bytes("AUTO") is None  # Dask's share of the machine
    assert memory_limit_bytes("0") is None and memory_limit_bytes("0.0") is None  # no limit, as Dask reads 0
    assert memory_limit_bytes(" 64MiB ") == MIN_MEMORY_LIMIT
    with pytest.raises(ValueError, match="has no unit"):  # Dask: 0.5 of the machine, or 100 bytes
        memory_limit_bytes("0.5")
    with pytest.raises(ValueError, match="has no unit"):
        memory_limit_bytes("100")
    with pytest.raises(ValueError, match="at least 64MiB"):
        memory_limit_bytes("10MB")
    with pytest.raises(ValueError, match=r"'banana': unknown unit 'banana'; write a size such as 4GiB"):
        memory_limit_bytes("banana")
