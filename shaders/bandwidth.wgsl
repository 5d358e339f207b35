// Device-memory bandwidth probe: a grid-stride copy of vec4<f32>; each element is read once and
// written once, so the bytes moved are twice the buffer size.

@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;

const WORKGROUP: u32 = 256u;

@compute @workgroup_size(256)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let stride = groups.x * WORKGROUP;
    let n = arrayLength(&src);
    for (var i = gid.x; i < n; i += stride) {
        dst[i] = src[i];
    }
}
