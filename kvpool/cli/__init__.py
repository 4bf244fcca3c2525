"""The `kvpool` command line (typer). Every subcommand imports its role lazily."""
