"""The spec language: parse (lark) -> AST -> resolved, checked kernel IR."""
