"""Runs rdma-core's own test suite (shipped by python3-pyverbs in
/usr/share/doc/rdma-core/tests, copied and gunzipped into SUITE_DIR by the caller) and prints
one line per test: `ID OUTCOME [DETAIL]`, OUTCOME one of ok, skip, fail, error.

Usage: run_suite.py SUITE_DIR   (run with Debian's /usr/bin/python3, which has pyverbs)

rdma-core's run_tests.py prints a test's docstring instead of its id in verbose mode; this
driver loads the same tests the same way (the suite's __init__.py and its load_tests) and
records each test's id with its outcome, so tests/debian_tools.rs can compare them with
tests/rdma-core/expected.txt."""
import os
import sys
import unittest
from importlib.machinery import SourceFileLoader

suite_dir = os.path.abspath(sys.argv[1])
sys.path.insert(0, suite_dir)
sys.argv = [sys.argv[0]]
from args_parser import parser  # noqa: E402  (the suite's own, read from suite_dir)

parser.parse_args()
tests = SourceFileLoader('tests', os.path.join(suite_dir, '__init__.py')).load_module()


def detail(err):
    """The last line of a traceback: the exception and its message."""
    text = ''.join(str(err[1]).splitlines()[-1:]) if err[1] is not None else ''
    return f'{err[0].__name__}: {text}'[:200]


class Lines(unittest.TestResult):
    def report(self, test, outcome, text=''):
        print(test.id(), outcome, text.replace('\n', ' '), flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self.report(test, 'ok')

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.report(test, 'skip', reason)

    def addError(self, test, err):
        super().addError(test, err)
        self.report(test, 'error', detail(err))

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.report(test, 'fail', detail(err))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.report(test, 'ok', 'expected failure')

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.report(test, 'fail', 'unexpected success')


suite = unittest.TestLoader().loadTestsFromModule(tests)
suite.run(Lines())
