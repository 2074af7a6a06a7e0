"""The course's tooling: pictures and widgets (`viz`), exercise checks (`check`), the grader
(`grade`) and the exercise generator (`exercises`). Depends on the core and `benchmark`; the
core never imports it."""
