"""How :func:`jaxcomp.distributed.diloco_ft.diloco_ft` sends its pseudo-gradients through the
quorum's store: :class:`Int8`.

``diloco_ft``'s exchange leaves XLA: each worker puts its pseudo-gradient as bytes, every member
gets every member's and averages them in rank order, so a codec here encodes one worker's flat
float32 vector on its own (no shared range, no collective) and decodes any member's bytes to the
same float32 values on every member. The worker keeps what the codec did not send as an
error-feedback residual, added to its next pseudo-gradient.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

__all__ = ["Int8"]


@dataclasses.dataclass(frozen=True)
class Int8:
    """8-bit codes, symmetric, with a float32 scale per chunk of ``chunk`` values: about a
    quarter of float32's bytes (``n + 4 * ceil(n / chunk)``).

    Args:
      chunk: values that share a scale (their largest magnitude maps to 127).

    Example:
      >>> import jax.numpy as jnp
      >>> codec = Int8(chunk=4)
      >>> codes, scales = codec.encode(jnp.array([1.0, -2.0, 0.5, 0.0, 4.0]))
      >>> codec.decode(codec.to_bytes(codes, scales), 5).tolist()
      [1.0078740119934082, -2.0, 0.5039370059967041, 0.0, 4.0]

    References:
      Jaghouar et al., "OpenDiLoCo" (arXiv 2407.07852): int8 pseudo-gradients, no loss seen.
    """

    chunk: int = 1024

    name = "int8"

    def __post_init__(self):
        chunk = self.chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")

    def encode(self, x):
        """``(codes int8[m], scales float32[m / chunk])`` of the flat float32 ``x`` (jittable;
        ``x`` zero-padded to whole chunks, ``m`` its padded length)."""
        pad = -x.size % self.chunk
        rows = jnp.pad(x.astype(jnp.float32), (0, pad)).reshape(-1, self.chunk)
        scales = jnp.max(jnp.abs(rows), axis=1) / 127.0
        safe = jnp.where(scales > 0, scales, 1.0)
        codes = jnp.clip(jnp.round(rows / safe[:, None]), -127, 127).astype(jnp.int8)
        return codes.ravel(), scales

    def decoded(self, codes, scales, n: int):
        """What :meth:`decode` gives, inside jit (the error feedback's sent part)."""
        rows = codes.reshape(-1, self.chunk).astype(jnp.float32) * scales[:, None]
        return rows.ravel()[:n]

    def to_bytes(self, codes, scales) -> bytes:
        """The payload: the scales (little-endian float32), then the codes."""
        return np.asarray(scales, "<f4").tobytes() + np.asarray(codes, np.int8).tobytes()

    def decode(self, body: bytes, n: int) -> np.ndarray:
        """The float32 vector of ``n`` values a payload of :meth:`to_bytes` carries.

        Raises:
          ValueError: ``body`` is not a payload of ``n`` values.
        """
        blocks = -(-n // self.chunk)
        if len(body) != blocks * (4 + self.chunk):
            raise ValueError(f"an int8 payload of {n} values has {blocks * (4 + self.chunk)} "
                             f"bytes, not {len(body)}")  # fmt: skip
        scales = np.frombuffer(body, "<f4", blocks)
        codes = np.frombuffer(body, np.int8, blocks * self.chunk, 4 * blocks)
        rows = codes.reshape(blocks, self.chunk).astype(np.float32) * scales[:, None]
        return rows.ravel()[:n]
