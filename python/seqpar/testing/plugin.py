"""pytest plugin (registered by `pip install`; from a checkout: `-p seqpar.testing.plugin`):
`--seqpar PATH` names the seqpar binary and `--seqpar-examples N` overrides max_examples of
every seqpar.testing property in the session."""
import os


def pytest_addoption(parser):
    g = parser.getgroup("seqpar")
    g.addoption("--seqpar", default=None, help="the seqpar binary seqpar.testing judges with")
    g.addoption("--seqpar-examples", type=int, default=None,
                help="max_examples of every seqpar.testing property")


def pytest_configure(config):
    if config.getoption("--seqpar"):
        from . import scenario
        scenario.explicit_binary = os.path.abspath(config.getoption("--seqpar"))
    if config.getoption("--seqpar-examples"):
        os.environ["SEQPAR_TESTING_EXAMPLES"] = str(config.getoption("--seqpar-examples"))
