"""The experiments, figures and recordings behind each notebook, one module or package per
notebook, named by its stem without the number. Lessons use the mechanisms; nothing below
imports a lesson."""
