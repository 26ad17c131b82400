"""The recipe: what a user writes, typed and validated once. Torch-free.

    config        every section as a frozen pydantic dataclass, every default once with its docstring
                  (model, lora, quant, data, train, sharding, cluster, eval ...); `load_recipe`
    objectives    the objectives' own sections: `dpo` (DPO, IPO, ORPO, SimPO, KTO) and `grpo`
    objective_checks  what each objective needs of the other sections (pairs or unpaired rows for
                  preference tuning in its loss's format, rewards for GRPO), checked once they validate
    io            YAML in and out, `section.key=value` overrides, the nearest-key error messages
    bounded_yaml  the one YAML reader of user files: a recursive anchor or an alias bomb is refused
    bounds        the value types numeric fields are validated with (finite, in their physical range)

Nothing is re-exported here: import each name from its module (`recipe.config.load_recipe`).
"""
