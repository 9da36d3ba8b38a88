"""Runs rdma-core's own test suite, as python3-pyverbs ships it in
/usr/share/doc/rdma-core/tests (copied into a temporary directory, its gzipped modules
unpacked), and prints one line per test: `RESULT ID OUTCOME [DETAIL]`, OUTCOME one of ok,
skip, fail, error (the tests' own processes print other lines). Then it compares each test
run with its line of EXPECTED (`ID OUTCOME # why`), prints every difference and exits 1 on
any.

Usage: run_suite.py EXPECTED [only=MODULE | except=MODULE]
(with Debian's /usr/bin/python3, which has pyverbs; MODULE as test_rdmacm)

rdma-core's run_tests.py prints a test's docstring instead of its id in verbose mode; this
driver loads the same tests the same way (the suite's __init__.py and its load_tests) and
records each test's id with its outcome."""
import gzip
import os
import shutil
import sys
import tempfile
import unittest
from importlib.machinery import SourceFileLoader

SHIPPED = '/usr/share/doc/rdma-core/tests'
expected_file = sys.argv[1]
select = sys.argv[2] if len(sys.argv) > 2 else ''
suite_dir = tempfile.mkdtemp(prefix='rdma-core-tests-')
for name in os.listdir(SHIPPED):
    src = os.path.join(SHIPPED, name)
    if not os.path.isfile(src):
        continue
    if name.endswith('.gz'):
        with gzip.open(src, 'rb') as f, open(os.path.join(suite_dir, name[:-3]), 'wb') as out:
            shutil.copyfileobj(f, out)
    else:
        shutil.copy(src, suite_dir)
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
    outcomes = {}

    def report(self, test, outcome, text=''):
        self.outcomes[test.id()] = (outcome, text)
        print('RESULT', test.id(), outcome, text.replace('\n', ' '), flush=True)

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


def flat(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from flat(t)
        else:
            yield t


def chosen(test):
    module = f'.{select.partition("=")[2]}.'
    if select.startswith('only='):
        return module in test.id()
    if select.startswith('except='):
        return module not in test.id()
    return True


suite = unittest.TestSuite(
    [t for t in flat(unittest.TestLoader().loadTestsFromModule(tests)) if chosen(t)])
ran = [t.id() for t in suite]  # a suite lets go of its tests as they run
result = Lines()
try:
    suite.run(result)
finally:
    shutil.rmtree(suite_dir, ignore_errors=True)
expected = {}
with open(expected_file) as f:
    for line in f:
        fields = line.split('#')[0].split()
        if len(fields) >= 2 and not line.startswith('#'):
            expected[fields[0]] = fields[1]
differ = []
for test_id in ran:
    got, why = result.outcomes.get(test_id, ('not run', ''))
    want = expected.get(test_id)
    if want is None:
        differ.append(f'{test_id}: not in {expected_file}, got {got} {why}')
    elif want != got:
        differ.append(f'{test_id}: expected {want}, got {got} {why}')
ok = sum(1 for t in ran if result.outcomes.get(t, ('',))[0] == 'ok')
print(f'SUMMARY {len(ran)} tests, {ok} ok, {len(differ)} differ from the expected outcome')
for d in differ:
    print('DIFFER', d)
sys.exit(1 if differ else 0)
