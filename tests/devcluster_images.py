"""Images the test session's devcluster nodes hold besides the project's own (a module, not
conftest, so any test folder can import it)."""

# A plain Python image for the node tests: any command, run with this interpreter.
TEST_PYTHON_IMAGE = "devcluster-test/python"
