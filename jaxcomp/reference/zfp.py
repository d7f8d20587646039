"""PLACEHOLDER: pure-JAX references of zfp_encode / zfp_decode."""


def zfp_encode(x, rate):
    raise NotImplementedError


def zfp_decode(words, n, rate, dtype=None):
    raise NotImplementedError
