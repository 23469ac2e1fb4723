"""Text out of the C strings the kernels and the CUDA driver fill in."""

from __future__ import annotations


def c_text(raw: bytes | str) -> str:
    """What ``ffi.string`` read from a C ``char`` string, decoded. cffi gives bytes for
    ``char`` (str only for ``wchar_t``, which no C code here uses); its stubs say either."""
    assert isinstance(raw, bytes), "ffi.string of a char string is bytes"
    return raw.decode(errors="replace")
