"""`python -m llamaspec ...` runs the command line."""
from .cli import main

main(prog_name="llamaspec")
