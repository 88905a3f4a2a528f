"""The test suite; its folders mirror the package (docs/architecture.md, "Layout").

A package so that shared doubles import by one name from every folder and from a test's
subprocess with the repository root on its path (``from tests.doubles import ...``), and so that
two folders may hold test files of the same name.
"""
