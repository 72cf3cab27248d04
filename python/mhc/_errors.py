"""``names_its_errors``: the public functions of every binding (mhc.jax, mhc.torch) name their
function first in the errors their argument checks raise. A module of its own, importing no
framework, so that each binding imports it without the others."""

from __future__ import annotations

import functools


def names_its_errors(function: str):
    """Decorator of a public function: the TypeError and ValueError raised while it runs (its
    argument checks, which name the argument) name ``function`` first, ``mhc.jax.pre: x: expected
    ...``. The outermost decorated function names them: the one the caller called (mhc.jax.pre on
    the plain path runs mhc.jax.reference.pre). An error that already names its function passes."""

    def decorate(wrapped):
        @functools.wraps(wrapped)
        def named(*args, **kwargs):
            try:
                return wrapped(*args, **kwargs)
            except (TypeError, ValueError) as error:
                _name_error(error, function)
                raise

        return named

    return decorate


def _name_error(error: Exception, function: str) -> None:
    if not error.args or not isinstance(error.args[0], str):
        return
    message, inner = error.args[0], getattr(error, "_mhc_function", None)
    if inner is not None:  # named by a decorated function this one called: this one's name instead
        message = message.removeprefix(f"{inner}: ")
    elif message.startswith("mhc."):  # written with its function's name
        return
    error.args = (f"{function}: {message}", *error.args[1:])
    error._mhc_function = function
