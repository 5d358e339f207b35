// f32 FMA-rate probe: every invocation runs ITERS rounds of fused multiply-adds on ACCS
// independent vec4 accumulators (enough independent chains to hide FMA latency), then writes one
// value so the compiler cannot drop the work. FLOPs = invocations × ITERS × ACCS × 4 lanes × 2.

@group(0) @binding(0) var<storage, read_write> sink: array<vec4<f32>>;

const ITERS: u32 = 512u;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    // Values stay bounded: x ← x·m + c converges to c / (1 − m).
    let m = vec4<f32>(0.999);
    let c = vec4<f32>(0.001);
    let s = f32(gid.x & 1023u) * 1e-6;
    var a0 = vec4<f32>(s, s + 0.1, s + 0.2, s + 0.3);
    var a1 = a0 + vec4<f32>(0.01);
    var a2 = a0 + vec4<f32>(0.02);
    var a3 = a0 + vec4<f32>(0.03);
    var a4 = a0 + vec4<f32>(0.04);
    var a5 = a0 + vec4<f32>(0.05);
    var a6 = a0 + vec4<f32>(0.06);
    var a7 = a0 + vec4<f32>(0.07);
    for (var i = 0u; i < ITERS; i++) {
        a0 = fma(a0, m, c);
        a1 = fma(a1, m, c);
        a2 = fma(a2, m, c);
        a3 = fma(a3, m, c);
        a4 = fma(a4, m, c);
        a5 = fma(a5, m, c);
        a6 = fma(a6, m, c);
        a7 = fma(a7, m, c);
    }
    sink[gid.x] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}
