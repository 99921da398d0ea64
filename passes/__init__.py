"""The passes that turn one IR into the next, and the pipeline that runs them."""
