// pybind11 surface of offload._aio_ext: raw pointers (ints) and sizes, no torch types.
// Every blocking call releases the GIL. IoError becomes OSError(errno, message, path).
#include <pybind11/pybind11.h>

#include "aio/crc32c.h"
#include "aio/engine.h"

namespace py = pybind11;
using namespace offload_aio;

namespace offload_aio {
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);
}

namespace {
char* as_ptr(uint64_t p) { return reinterpret_cast<char*>(static_cast<uintptr_t>(p)); }
}  // namespace

PYBIND11_MODULE(_aio_ext, m) {
  m.doc() = "offload asynchronous file I/O engine (thread pool, pread/pwrite) and CRC-32C";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      py::object exc = py::reinterpret_borrow<py::object>(PyExc_OSError)(e.err, e.msg, e.path);
      PyErr_SetObject(PyExc_OSError, exc.ptr());
    }
  });

  py::enum_<Op>(m, "Op").value("READ", Op::Read).value("WRITE", Op::Write);

  py::class_<Request, std::shared_ptr<Request>>(m, "Request")
      .def("wait", &Request::wait, py::arg("timeout") = -1.0, py::call_guard<py::gil_scoped_release>(),
           "Block until done (timeout < 0: forever); False on timeout; OSError if any piece failed.")
      .def("done", &Request::done)
      .def_property_readonly("checksum", &Request::checksum)
      .def_property_readonly("nbytes", &Request::nbytes);

  py::class_<Engine>(m, "Engine")
      .def(py::init<size_t, size_t, size_t, size_t>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("threads"), py::arg("background_depth") = 0)
      .def(
          "submit",
          [](Engine& e, Op op, int fd, uint64_t ptr, uint64_t offset, size_t nbytes, size_t crc_nbytes,
             bool want_crc, size_t piece_size, const std::string& path, bool urgent) {
            return e.submit(op, fd, as_ptr(ptr), offset, nbytes, crc_nbytes, want_crc, piece_size, path,
                            urgent);
          },
          py::arg("op"), py::arg("fd"), py::arg("ptr"), py::arg("offset"), py::arg("nbytes"),
          py::arg("crc_nbytes"), py::arg("want_crc"), py::arg("piece_size"), py::arg("path"),
          py::arg("urgent") = false)
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def("set_fault", &Engine::set_fault, py::arg("op"), py::arg("err"), py::arg("after_offset"),
           py::arg("count") = -1)
      .def("clear_fault", &Engine::clear_fault)
      .def("set_delay_us", &Engine::set_delay_us, py::arg("us"), py::arg("op") = -1)
      .def_property_readonly("block_size", &Engine::block_size)
      .def_property_readonly("queue_depth", &Engine::queue_depth)
      .def_property_readonly("threads", &Engine::threads)
      .def_property_readonly("background_depth", &Engine::background_depth);

  m.def(
      "crc32c", [](uint64_t ptr, size_t n, uint32_t crc) { return crc32c_extend(crc, as_ptr(ptr), n); },
      py::arg("ptr"), py::arg("nbytes"), py::arg("crc") = 0, py::call_guard<py::gil_scoped_release>());
  m.def(
      "crc32c_bytes",
      [](py::bytes b, uint32_t crc, bool portable) {
        std::string s = b;
        return portable ? crc32c_extend_portable(crc, s.data(), s.size())
                        : crc32c_extend(crc, s.data(), s.size());
      },
      py::arg("data"), py::arg("crc") = 0, py::arg("portable") = false);
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"));
  m.def("crc32c_hardware", &crc32c_hardware);
}
