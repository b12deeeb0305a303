"""Room for swap files' descriptors under the process's limit on open files."""

import errno
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload.platform.descriptors import SPARE_DESCRIPTORS, DescriptorLimitError, soft_limit_for


def test_soft_limit_for_cases():
    assert soft_limit_for(100, 500, 1024, 4096) == 1024  # fits already: unchanged
    assert soft_limit_for(100, 1000, 1024, 4096) == 100 + 1000 + SPARE_DESCRIPTORS
    assert soft_limit_for(100, 10**6, 1024, -1) == 100 + 10**6 + SPARE_DESCRIPTORS  # hard unlimited
    with pytest.raises(DescriptorLimitError, match="hard limit on open files is 4096") as e:
        soft_limit_for(100, 4000, 1024, 4096)
    assert e.value.errno == errno.EMFILE


@given(
    open_now=st.integers(0, 10**5),
    needed=st.integers(0, 10**5),
    soft=st.integers(1, 10**6),
    hard=st.one_of(st.just(-1), st.integers(1, 10**6)),
)
def test_soft_limit_for_fits_or_refuses(open_now, needed, soft, hard):
    want = open_now + needed + SPARE_DESCRIPTORS
    try:
        limit = soft_limit_for(open_now, needed, soft, hard)
    except DescriptorLimitError:
        assert soft < want and 0 <= hard < want
        return
    assert limit >= want and limit >= soft
    assert limit == soft or limit == want  # raised only as far as needed
    assert hard < 0 or limit <= max(hard, soft)


def test_reserve_raises_the_soft_limit_or_names_the_hard_one(tmp_path):
    """In a child (a lowered hard limit cannot be raised again): reserving more files than the
    soft limit holds raises it; more than the hard limit allows fails before any file is made."""
    script = textwrap.dedent(
        f"""
        import resource, torch
        from offload.errors import SwapError
        from offload.storage.swap import SwapStore
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 1200))
        store = SwapStore({str(tmp_path)!r}, run_name="t")
        store.reserve({{f"a{{i}}": (10, torch.float32) for i in range(300)}})
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert soft >= 300 + 256, soft
        before = sorted(store.names())
        try:
            store.reserve({{f"b{{i}}": (10, torch.float32) for i in range(1000)}})
        except SwapError as e:
            assert "hard limit on open files is 1200" in str(e) and "ulimit -n" in str(e), e
            assert sorted(store.names()) == before
            print("refused", e.errno)
        store.close()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", str(errno.EMFILE)]
