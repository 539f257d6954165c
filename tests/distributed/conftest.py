"""The ``slow`` marker: distributed cases that run Triton kernels in the interpreter take
minutes on a small machine; ``-m "not slow"`` is the quick subset."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes on a 2-core CPU machine; -m 'not slow' skips it")
