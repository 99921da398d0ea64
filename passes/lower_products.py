"""The decayed products' TileLang templates (a part of passes/lower_tilelang.py's renderer).

A decayed_product statement forms Σ_k X_ik Z_jk e^{γ_ik − γ_jk} on the diagonal sub-blocks of a
per-key gate's chunk (passes/rewrite_subchunk.py), or one of its VJP's two sums, without storing
the exponentials: these templates say which thread takes which rows, columns or triangle slots
(the statement's `slots`: passes/schedule_build.product_slots), and where it sums.
tests/test_product_templates.py runs each template's generated lines thread by thread on the CPU
against the einsum.
"""
from __future__ import annotations

from qla_compiler.errors import PassError
from qla_compiler.ir.chunk_ops import COLS_PRODUCT, ROWS_PRODUCT
from qla_compiler.ir.kernel import Stmt

CHUNK_SIZE = 64  # the chunk the kernels are built and tested for (thread mapping)


def _products(s: Stmt) -> list:
    """(X, result, scratch block) of each product a decayed_product statement forms: its own, and
    a paired second one's (KDA's q ⋆ k beside k ⋆ k)."""
    second = [(s.srcs[3], s.attr["second"][1], s.attr["second_scratch"][1])] if s.attr.get("second") else []
    return [(s.srcs[0], s.dst, s.attr["scratch"][1])] + second


class ProductTemplates:
    """The renderer's decayed-product templates (mixed into lower_tilelang._Render, whose
    `k`, `shape`, `aliases` and `_buf_shape` they read)."""

    def _decayed_product_rows(self, s: Stmt, exp: str, scan: bool) -> list[str]:
        """Σ_k X_ik Z_jk e^{γ_ik − γ_jk} on the diagonal sub-blocks, j ≤ i, e^{...} never stored.
        A thread takes one row i and `cols` columns of i's block: per k it loads X_ik and γ_ik once
        for all of them, then per column Z_jk, γ_jk, one exponential and one multiply-add (8
        instructions an element and k, against ~22 where each element of the wgmma accumulator's
        fragment walked k itself: at 16/16:8x4096 on the H200 KDA's prep 1.84 → 1.28 ms, GLA's out
        1.11 → 1.00, NOTES session 25). The sums reach the product's fragment through the C×B
        float32 block `scratch` in shared memory. k starts at 2·(i mod 32) in each row: one column
        of 32 rows 256 bytes apart would be one bank."""
        x, z, g = s.srcs[:3]
        B, scratch = s.attr["block"], s.attr["scratch"][1]
        threads = self.k.threads
        if scan or not isinstance(threads, int) or threads % CHUNK_SIZE or B % (threads // CHUNK_SIZE):
            raise PassError("lower", f"{s}: a thread a row takes a parallel kernel whose threads are a multiple of "
                                     f"C = {CHUNK_SIZE} dividing the block's {B} columns, not {threads}"
                                     + (" in a scan" if scan else ""))
        per_row = threads // CHUNK_SIZE
        cols = B // per_row
        width = self._buf_shape(x).split(", ")[1]
        row, col = f"i_t // {per_row}", f"i_t // {per_row} // {B} * {B} + i_t % {per_row} * {cols} + c"
        k = f"(i_k + 2 * (i_t // {per_row} % 32)) % {width}"
        # with a second X (a paired product: KDA's q beside k), its row too, and per element the
        # factor Z_jk e^{γ_ik − γ_jk} once for both sums
        pairs = _products(s)
        n = len(pairs)
        factor = f"T.cast({z}[{col}, {k}], \"float32\") * {exp}({scratch}_row[{n}] - {g}[{col}, {k}])"
        lines = ["i_t = T.get_thread_binding()"]
        lines += [f"{sc}_acc = T.alloc_local(({cols},), \"float32\")" for _, _, sc in pairs]
        lines.append(f"{scratch}_row = T.alloc_local(({n + 1},), \"float32\")  # "
                     + ("X_ik and γ_ik" if n == 1 else "X_ik of each, then γ_ik"))
        if n > 1:
            lines.append(f"{scratch}_e = T.alloc_local((1,), \"float32\")  # Z_jk e^(γ_ik − γ_jk)")
        lines.append(f"for c in T.serial({cols}):")
        lines += [f"    {sc}_acc[c] = 0.0" for _, _, sc in pairs]
        lines.append(f"for i_k in T.serial({width}):")
        lines += [f"    {scratch}_row[{i}] = T.cast({xx}[{row}, {k}], \"float32\")"
                  for i, (xx, _, _) in enumerate(pairs)]
        lines += [f"    {scratch}_row[{n}] = {g}[{row}, {k}]", f"    for c in T.unroll({cols}):"]
        if n == 1:
            lines.append(f"        {scratch}_acc[c] += {scratch}_row[0] * {factor}")
        else:
            lines.append(f"        {scratch}_e[0] = {factor}")
            lines += [f"        {sc}_acc[c] += {scratch}_row[{i}] * {scratch}_e[0]"
                      for i, (_, _, sc) in enumerate(pairs)]
        lines.append(f"for c in T.serial({cols}):  # j ≤ i: the terms past the diagonal are another row's")
        lines += [f"    {sc}[{row}, i_t % {per_row} * {cols} + c] = T.if_then_else("
                  f"i_t % {per_row} * {cols} + c <= {row} % {B}, {sc}_acc[c], 0.0)" for _, _, sc in pairs]
        lines += ["T.sync_threads()", "for i, j in T.Parallel(C, C):"]
        lines += [f"    {dst}[i, j] = T.if_then_else(i // {B} == j // {B}, {sc}[i, j % {B}], 0.0)"
                  for _, dst, sc in pairs]
        return lines

    def _decayed_product_triangle(self, s: Stmt, exp: str, scan: bool) -> list[str]:
        """Σ_k X_ik Z_jk e^{γ_ik − γ_jk} over each diagonal B-block's lower triangle alone (j ≤ i):
        B(B+1)/2 elements where a thread a row (_decayed_product_rows) walks B², half of them past
        the diagonal. With h = B/2 the triangle is three h × h pieces: the full tile L under the
        diagonal (rows h…B−1, columns 0…h−1), and the two triangles on it, D0 (rows and columns
        0…h−1) and D1 (h…B−1), folded into one square: its slot (r, c) is D0's (r, c) where c ≤ r,
        else D1's (B−1−r, B−1−c), strictly below D1's diagonal. D1's diagonal (e^0: no exponential)
        is a sum a thread of L adds on the side. Per block, 2·h·p threads (p = threads / C) take a
        tile row's h / p columns each: rows A and B, a threshold, and per slot a select between
        (A, c) and (B, B−1−c), compile-time columns apart from the thread's base, so the reads of Z
        and γ cost an add, not an address computation (session 37's row-from-a-table slots took
        ~30 integer operations a read). Keys go two at a time, each thread starting at its lane's
        pair: the lanes' reads of a row fall in distinct banks. The sums reach the result through
        the C×B float32 block `scratch`; its entries above the diagonal are never written (the
        final read masks them)."""
        x, z, g = s.srcs[:3]
        B, scratch = s.attr["block"], s.attr["scratch"][1]
        threads = self.k.threads
        if scan or not isinstance(threads, int) or threads % CHUNK_SIZE or B % 2 \
                or (B // 2) % (threads // CHUNK_SIZE):
            raise PassError("lower", f"{s}: triangle slots take a parallel kernel whose threads are a multiple of "
                                     f"C = {CHUNK_SIZE} and deal each tile row's {B // 2} columns evenly, not {threads}"
                                     + (" in a scan" if scan else ""))
        h, p = B // 2, threads // CHUNK_SIZE
        w = h // p  # a thread's columns of its tile row
        width = self._buf_shape(x).split(", ")[1]
        pairs = _products(s)
        n = len(pairs)
        b0 = f"i_t // {B * p} * {B}"
        sq = f"i_t % {B * p} // {h * p}"  # 0: the tile L, 1: the folded square
        r = f"i_t % {h * p} // {p}"
        row_a = f"{b0} + {h} - {sq} * {h} + {r}"  # L: h + r; the square: r (D0's row)
        row_b = f"{b0} + {h} + {r} + {sq} * ({h - 1} - 2 * ({r}))"  # L: h + r; the square: B − 1 − r (D1's)
        thr = f"{r} + (1 - {sq}) * ({h - 1} - ({r}))"  # the square's (A, c) where c ≤ r; L's always
        cc = f"i_t % {p} * {w} + c"
        on_a = f"{cc} <= {thr}"
        # (as sums with the condition cast to 0 or 1, not selects: TileLang bounds them and keeps
        # the indices int32, where a select's index went int64)
        a01 = f"T.cast({on_a}, \"int32\")"
        row = f"{row_b} + {a01} * ({row_a} - ({row_b}))"
        col = f"{b0} + {B - 1} - ({cc}) + {a01} * (2 * ({cc}) - {B - 1})"
        kk = f"{scratch}_k"  # the pair of keys this step reads: 2 ((lane + step) mod width/2)
        x_ab = f"{scratch}_x"  # X_ik of rows A, then B, for each product, at both keys
        g_ab = f"{scratch}_g"  # γ_ik of rows A and B at both keys
        z_c, g_c = f"{scratch}_z", f"{scratch}_gz"  # Z_jk and γ_jk of each slot's column, at both keys
        # Z's row B on D1's diagonal: a product's own X there where its X is Z (k ⋆ k), else read
        own = next((n + i for i, (xx, _, _) in enumerate(pairs) if xx == z), None)
        z_b = f"{x_ab}[{own}, e]" if own is not None else f"{z_c}_b[e]"
        lines = ["i_t = T.get_thread_binding()"]
        lines += [f"{sc}_acc = T.alloc_local(({w},), \"float32\")" for _, _, sc in pairs]
        lines += [f"{sc}_diag = T.alloc_local((1,), \"float32\")  # D1's diagonal, e^0" for _, _, sc in pairs]
        lines += [f"{x_ab} = T.alloc_local(({2 * n}, 2), \"float32\")",
                  f"{g_ab} = T.alloc_local((2, 2), \"float32\")",
                  f"{z_c} = T.alloc_local(({w}, 2), \"float32\")",
                  f"{g_c} = T.alloc_local(({w}, 2), \"float32\")"]
        lines += [f"{z_c}_b = T.alloc_local((2,), \"float32\")"] if own is None else []
        lines += [f"{scratch}_e = T.alloc_local((1,), \"float32\")  # Z_jk e^(γ_ik − γ_jk)",
                  f"for c in T.serial({w}):"]
        lines += [f"    {sc}_acc[c] = 0.0" for _, _, sc in pairs]
        lines += [f"{sc}_diag[0] = 0.0" for _, _, sc in pairs]
        lines += [f"for i_k in T.serial({width} // 2):",
                  f"    {kk} = 2 * ((i_t % 32 + i_k) % ({width} // 2))"]
        # (each a two-key vector read: a word of bf16 pairs, a float2 of γ)
        loads = [(f"{x_ab}[{i}, e]", f"T.cast({xx}[{row_a}, {kk} + e], \"float32\")") for i, (xx, _, _) in enumerate(pairs)]
        loads += [(f"{x_ab}[{n + i}, e]", f"T.cast({xx}[{row_b}, {kk} + e], \"float32\")")
                  for i, (xx, _, _) in enumerate(pairs)]
        loads += [(f"{g_ab}[0, e]", f"{g}[{row_a}, {kk} + e]"), (f"{g_ab}[1, e]", f"{g}[{row_b}, {kk} + e]")]
        for dst, src in loads:
            lines += ["    for e in T.vectorized(2):", f"        {dst} = {src}"]
        lines += [f"    for c in T.unroll({w}):",
                  "        for e in T.vectorized(2):",
                  f"            {z_c}[c, e] = T.cast({z}[{col}, {kk} + e], \"float32\")",
                  "        for e in T.vectorized(2):",
                  f"            {g_c}[c, e] = {g}[{col}, {kk} + e]"]
        if own is None:
            lines += ["    for e in T.vectorized(2):", f"        {z_c}_b[e] = T.cast({z}[{row_b}, {kk} + e], \"float32\")"]
        lines.append("    for e in T.unroll(2):")
        lines += [f"        {sc}_diag[0] += {x_ab}[{n + i}, e] * {z_b}" for i, (_, _, sc) in enumerate(pairs)]
        lines += [f"        for c in T.unroll({w}):",
                  f"            {scratch}_e[0] = {z_c}[c, e] * "
                  f"{exp}(T.if_then_else({on_a}, {g_ab}[0, e], {g_ab}[1, e]) - {g_c}[c, e])"]
        lines += [f"            {sc}_acc[c] += T.if_then_else({on_a}, {x_ab}[{i}, e], {x_ab}[{n + i}, e]) * {scratch}_e[0]"
                  for i, (_, _, sc) in enumerate(pairs)]
        lines.append(f"for c in T.serial({w}):")
        lines += [f"    {sc}[{row}, {col} - {b0}] = {sc}_acc[c]" for _, _, sc in pairs]
        lines.append(f"if {sq} == 0 and i_t % {p} == 0:  # L's threads hold D1's diagonal (their rows A = B)")
        lines += [f"    {sc}[{row_b}, {row_b} - {b0}] = {sc}_diag[0]" for _, _, sc in pairs]
        lines += ["T.sync_threads()", "for i, j in T.Parallel(C, C):"]
        lines += [f"    {dst}[i, j] = T.if_then_else(i // {B} == j // {B} and j <= i, {sc}[i, j % {B}], 0.0)"
                  for _, dst, sc in pairs]
        return lines

    def _decayed_product_vjp_pairs(self, s: Stmt, exp: str, scan: bool) -> list[str]:
        """The VJP's products (d P ⋆_rows Z: row i sums the block's m ≤ i; d P ⋆_cols X: m ≥ i) over
        the terms inside the triangle alone, where _decayed_product_vjp walks all B of a block's m
        for every element and selects half of them away. A block's row r has r + 1 terms, its row
        B − 1 − r has B − r (the other way round for ⋆_cols): a thread takes the pair, B + 1 terms
        for two rows, and a column slice of both. The pairs of one r in the C / B blocks sit side by
        side, so a warp's threads walk loops of one length (at 256 threads; two lengths at 128).
        Each term is a load of d P, then per column Z (or X) and γ_m at compile-time offsets, one
        exponential and a multiply-add: about half the exponentials and instructions of walking
        every m. The sums reach the result through the C × width float32 block `scratch`."""
        w_, y, g = s.srcs
        B, scratch = s.attr["block"], s.attr["scratch"][1]
        threads = self.k.threads
        width = self._width(s.dst)
        pairs = CHUNK_SIZE // 2
        if scan or not isinstance(threads, int) or threads % pairs or width % (threads // pairs) or B % 2:
            raise PassError("lower", f"{s}: row pairs take a parallel kernel whose threads are a multiple of the "
                                     f"chunk's {pairs} row pairs and divide its {width} columns among each pair's "
                                     f"threads, not {threads}" + (" in a scan" if scan else ""))
        q = threads // pairs  # threads a pair
        cw = width // q  # columns a thread
        rows_eq = s.attr["eq"] == ROWS_PRODUCT
        if not rows_eq and s.attr["eq"] != COLS_PRODUCT:
            raise PassError("lower", f"{s}: no template for a decayed product {s.attr['eq']}")
        pair = f"i_t // {q}"
        b0 = f"{pair} % {CHUNK_SIZE // B} * {B}"  # (the pairs of one r side by side)
        r = f"{pair} // {CHUNK_SIZE // B}"
        k0 = f"i_t % {q} * {cw}"
        rows = [(f"{b0} + {r}", f"{r} + 1" if rows_eq else f"{B} - {r}"),
                (f"{b0} + {B - 1} - {r}", f"{B} - {r}" if rows_eq else f"{r} + 1")]
        lines = ["i_t = T.get_thread_binding()"]
        for n in (1, 2):
            lines += [f"{scratch}_acc{n} = T.alloc_local(({cw},), \"float32\")"]
        lines += [f"{scratch}_gi = T.alloc_local(({cw},), \"float32\")  # γ_i of the row being summed",
                  f"{scratch}_w = T.alloc_local((1,), \"float32\")  # d P's term"]
        for n, (i, count) in enumerate(rows, 1):
            m = f"{b0} + i_m" if rows_eq else f"{i} + i_m"
            coef = f"{w_}[{i}, {m}]" if rows_eq else f"{w_}[{m}, {i}]"
            decay = (f"{scratch}_gi[c] - {g}[{m}, {k0} + c]" if rows_eq else f"{g}[{m}, {k0} + c] - {scratch}_gi[c]")
            lines += [f"for c in T.unroll({cw}):",
                      f"    {scratch}_acc{n}[c] = 0.0",
                      f"    {scratch}_gi[c] = {g}[{i}, {k0} + c]",
                      f"for i_m in T.serial({count}):",
                      f"    {scratch}_w[0] = T.cast({coef}, \"float32\")",
                      f"    for c in T.unroll({cw}):",
                      f"        {scratch}_acc{n}[c] += {scratch}_w[0] * T.cast({y}[{m}, {k0} + c], \"float32\") * "
                      f"{exp}({decay})",
                      f"for c in T.unroll({cw}):",
                      f"    {scratch}[{i}, {k0} + c] = {scratch}_acc{n}[c]"]
        shape = self._buf_shape(s.dst)
        return lines + ["T.sync_threads()", f"for i, j in T.Parallel({shape}):", f"    {s.dst}[i, j] = {scratch}[i, j]"]

    def _width(self, name: str) -> int:
        """The columns of a C × (K or V) block, as a number: a key block's, else the head dim's tile."""
        d = next(b for b in self.k.buffers if b.name == self.aliases.get(name, name)).shape[1]
        if d == "K" and self.k.key_block:
            return self.k.key_block
        return {"K": self.shape.KP, "V": self.shape.VP, "BK": self.k.key_block}.get(d) or int(d)

    def _decayed_product_vjp(self, s: Stmt, exp: str) -> list[str]:
        """The VJP's products on the diagonal sub-blocks, a C×K result: d P ⋆_rows Z (eq
        ij,jk,ijk->ik: row i sums over the block's columns m ≤ i) and d P ⋆_cols X (ij,ik,ijk->jk:
        row i of the result sums over the block's rows m ≥ i); R is never stored. The block's m
        outermost, the thread's elements of the result inside: its two rows share their d P loads,
        its columns their Z and γ_m loads, and its sums are independent of each other. (Each element
        walking m itself took 2.7× longer on the H200: dependent loads, 2 warps a scheduler, and
        code that missed the instruction cache: NOTES, session 25.) The terms past the diagonal are
        selected away (their e^{...} may be inf)."""
        w, y, g = s.srcs
        B = s.attr["block"]
        m = f"i // {B} * {B} + i_m"  # the block's row or column summed over
        if s.attr["eq"] == ROWS_PRODUCT:
            keep, term = f"{m} <= i", f"T.cast({w}[i, {m}], \"float32\") * T.cast({y}[{m}, j], \"float32\") * {exp}({g}[i, j] - {g}[{m}, j])"
        elif s.attr["eq"] == COLS_PRODUCT:
            keep, term = f"{m} >= i", f"T.cast({w}[{m}, i], \"float32\") * T.cast({y}[{m}, j], \"float32\") * {exp}({g}[{m}, j] - {g}[i, j])"
        else:
            raise PassError("lower", f"{s}: no template for a decayed product {s.attr['eq']}")
        shape = self._buf_shape(s.dst)
        return [f"for i, j in T.Parallel({shape}):",
                f"    {s.dst}[i, j] = 0.0",
                f"for i_m in T.serial({B}):",
                f"    for i, j in T.Parallel({shape}):",
                f"        {s.dst}[i, j] += T.if_then_else({keep}, {term}, 0.0)"]
