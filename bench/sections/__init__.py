"""Each benchmark's published Markdown: one module per benchmark, each with its `SECTIONS` (the kept results it
renders) and, where the README quotes it, `headline(results)`. Plain Python, no torch: `bench/report.py` assembles
docs/PERFORMANCE.md and the README's measured lines from these, in CI too."""
