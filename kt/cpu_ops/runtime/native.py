"""Calls between compiled functions by address: a jitted function's native entry point, and the
``icallN`` intrinsics that call one from jitted code.

A direct call would link the callee's LLVM IR into the caller and generate its machine code again
(minutes for the big unrolled SIMD kernels); an indirect call runs the code compiled (or loaded
from the cache) once. The pool's worker loop calls its job this way (``icall3``), and the MoE
driver its GEMM kernels (``icall8`` / ``icall5``), so neither is compiled again per job or kernel.
"""
from __future__ import annotations

from numba import types
from numba.extending import intrinsic

__all__ = ["native_address", "icall_codegen", "icall3", "icall5", "icall8", "ptr"]


def icall_codegen(context, builder, sig, args):
    """Codegen of ``icallN(addr, *args)``: call the numba-compiled function at ``addr`` (its
    native entry point) with ``args``, propagating a raised exception."""
    argtys = sig.args[1:]
    fnty = context.call_conv.get_function_type(types.none, argtys)
    fn = builder.inttoptr(args[0], fnty.as_pointer())
    status, _ = context.call_conv.call_function(builder, fn, types.none, argtys, args[1:])
    with builder.if_then(status.is_error, likely=False):
        context.call_conv.return_status_propagate(builder, status)
    return context.get_dummy_value()


@intrinsic
def icall3(typingctx, addr, a0, a1, a2):
    if not isinstance(addr, types.Integer):
        return None
    return types.void(addr, a0, a1, a2), icall_codegen


@intrinsic
def icall5(typingctx, addr, a0, a1, a2, a3, a4):
    """``icall8`` with five arguments (the BF16 kernel signature)."""
    if not isinstance(addr, types.Integer):
        return None
    return types.void(addr, a0, a1, a2, a3, a4), icall_codegen


@intrinsic
def icall8(typingctx, addr, a0, a1, a2, a3, a4, a5, a6, a7):
    """Call the compiled function at ``addr`` (its native entry point, ``native_address``)
    with eight arguments; it must have been compiled for exactly these types."""
    if not isinstance(addr, types.Integer):
        return None
    return types.void(addr, a0, a1, a2, a3, a4, a5, a6, a7), icall_codegen


def native_address(dispatcher, argtypes: tuple) -> int:
    """Compile ``dispatcher`` for ``argtypes`` (it must return None) and return the address of
    its native entry point, for an indirect call from jitted code. Calling through the address
    does not link (and code-generate again) the callee's IR into the caller."""
    dispatcher.compile(argtypes)
    cres = dispatcher.overloads[argtypes]
    if cres.signature.return_type != types.none:
        raise TypeError(f"{dispatcher} must return None, returns {cres.signature.return_type}")
    return int(cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name))


@intrinsic
def ptr(typingctx, addr, dt):
    """int address -> CPointer(dtype) (dt: a numpy scalar class such as np.float32)."""
    if not isinstance(addr, types.Integer) or not isinstance(dt, types.NumberClass):
        return None
    pty = types.CPointer(dt.instance_type)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(pty))

    return pty(addr, dt), codegen
