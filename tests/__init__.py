"""trainguard's tests (a package, so that a `tests` package another library installs, as
verl's wheel does, cannot shadow `tests.integration`)."""
