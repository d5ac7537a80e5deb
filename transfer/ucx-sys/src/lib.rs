//! Raw bindings to UCX's UCP API (`ucp/api/ucp.h`), generated at build time by bindgen from
//! the installed headers, plus the few header macros and inline functions bindgen cannot carry
//! over (`ucp_init`, `UCS_PTR_IS_ERR`, `UCS_PTR_STATUS`, `UCS_PTR_IS_PTR`). Everything here is
//! `unsafe` C API; `kvtier-transfer`'s `ucx` backend is the safe layer.

#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code
)]
#![allow(clippy::all)]
#![allow(unsafe_op_in_unsafe_fn)]

include!(concat!(env!("OUT_DIR"), "/ucp.rs"));

/// `UCS_PTR_IS_ERR`: UCX encodes a status in a pointer as `(uintptr_t)ptr >= (uintptr_t)UCS_ERR_LAST`.
#[inline]
pub fn ucs_ptr_is_err<T>(ptr: *const T) -> bool {
    (ptr as usize) >= (UCS_ERR_LAST as isize as usize)
}

/// `UCS_PTR_IS_PTR`: a real pointer (neither NULL nor an encoded error).
#[inline]
pub fn ucs_ptr_is_ptr<T>(ptr: *const T) -> bool {
    (ptr as usize).wrapping_sub(1) < ((UCS_ERR_LAST as isize as usize).wrapping_sub(1))
}

/// `UCS_PTR_STATUS`: the status a pointer encodes (`UCS_OK` for NULL, `UCS_INPROGRESS` for
/// a request pointer).
#[inline]
pub fn ucs_ptr_status<T>(ptr: *const T) -> ucs_status_t {
    if ptr.is_null() {
        UCS_OK as ucs_status_t
    } else if ucs_ptr_is_err(ptr) {
        ptr as isize as ucs_status_t
    } else {
        UCS_INPROGRESS as ucs_status_t
    }
}

/// `ucp_init` (an inline function in ucp.h): `ucp_init_version` with this header's API version.
///
/// # Safety
/// As for `ucp_init_version`: `params` must be valid, `config` NULL or from
/// `ucp_config_read`, `context_p` writable.
#[inline]
pub unsafe fn ucp_init(
    params: *const ucp_params_t,
    config: *const ucp_config_t,
    context_p: *mut ucp_context_h,
) -> ucs_status_t {
    ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, params, config, context_p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_status_macros() {
        assert!(!ucs_ptr_is_err(std::ptr::null::<u8>()));
        assert!(!ucs_ptr_is_ptr(std::ptr::null::<u8>()));
        assert_eq!(
            ucs_ptr_status(std::ptr::null::<u8>()),
            UCS_OK as ucs_status_t
        );
        let err = UCS_ERR_NO_MEMORY as isize as usize as *const u8;
        assert!(ucs_ptr_is_err(err));
        assert!(!ucs_ptr_is_ptr(err));
        assert_eq!(ucs_ptr_status(err), UCS_ERR_NO_MEMORY as ucs_status_t);
        let x = 5u64;
        let p = &x as *const u64;
        assert!(ucs_ptr_is_ptr(p));
        assert_eq!(ucs_ptr_status(p), UCS_INPROGRESS as ucs_status_t);
    }

    #[test]
    fn init_and_cleanup_a_context() {
        // SAFETY: the params struct is zeroed then filled per ucp.h; the context is cleaned up.
        unsafe {
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask = UCP_PARAM_FIELD_FEATURES as u64;
            params.features = UCP_FEATURE_RMA as u64;
            let mut ctx: ucp_context_h = std::ptr::null_mut();
            let status = ucp_init(&params, std::ptr::null(), &mut ctx);
            assert_eq!(status, UCS_OK as ucs_status_t);
            assert!(!ctx.is_null());
            ucp_cleanup(ctx);
        }
    }
}
